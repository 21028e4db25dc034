"""SLO-aware packed prefill (FlowPrefill's prefill batching) on batched workers.

When a batched worker's prefill frees, the request placed there may take the requests ranked
right after it into the same forward (``worker.packed_prefill``: whole prompts concatenated,
a block-diagonal causal mask). One forward over several short prompts wastes far less of the
machine than one forward each. A pack is formed only when:

- every member is a short, fresh prompt (``max_pack_tokens`` together, no state anywhere, no
  token produced yet: a dropped decode recomputes alone), and the worker has a KV slot for each;
- every member is of the first member's tier. A pack is preempted as one (below), so a pack
  that mixed tiers would let a higher tier's arrival stop the higher-tier members it carries;
- every member is of the first member's API key. Every member's first token comes at the
  pack's end, so a rider spends the slack of the members before it; fair order ranks the
  other keys' requests after the head's by their keys' shares (``fairness``), and a rider of
  another key would spend a key's slack on a key that may be past its share. Measured on the
  flood (docs/results.md, "One key floods the critical tier"): a calm key's short prompt
  prefilled alone in 55 ms took 80-176 ms in packs that the flooding key's requests rode;
- members are taken in the policy's order (requests placed on other workers are skipped). A
  prefill that cannot be packed (a suspended one, a long prompt) is passed over only while the
  pack still lets it make its deadline when it starts after the pack; otherwise, and at a
  decoding request, the pack ends. Passing matters under preemption: a suspended lower-tier
  prefill ranked between short fresh prompts would otherwise keep every one of them alone;
- the pack's predicted time, inflated by the predictor's error margin, still meets the
  tightest deadline among its members (members that would miss theirs even alone, and so gain
  nothing from waiting, do not constrain it; the same for the requests passed over).

The pack's cost is learnt (``PackCost``): packed prefills are measured like single ones and fit
with the same model over the pack's total tokens; until enough packs were measured the
single-prompt predictor of as many tokens stands in (the packed row's attention is computed
densely under the mask, so a pack costs about what a prompt of its total length does).

A pack is one unit of work on its worker: its first member holds the worker's prefill
(``WorkerSlot.active``), the others ride along (``WorkerSlot.riders``), a preemption stops and
suspends all of it, a resume of any member resumes all of it. Only a higher tier preempts a
pack (``planner._pick_victim``): its members' deadlines are as tight as any newcomer's of their
tier, and stopping several of them for one would loop (preempt, re-pack with the newcomer,
preempt again at the next arrival).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from queue_service.scheduler.planner import Estimator
from queue_service.scheduler.predictor import PrefillSample, PrefillTimePredictor
from queue_service.scheduler.request import Request, RequestState, WorkerSlot


@dataclass(frozen=True)
class PackLimits:
    max_size: int  # requests in one pack; below 2: no packing
    max_tokens: int  # prompt tokens of one pack together


class PackCost:
    """Predicted seconds of a packed prefill of ``tokens`` prompt tokens, learnt from packs."""

    def __init__(self, single: PrefillTimePredictor, *, min_samples: int = 8) -> None:
        self.single = single
        self.own = PrefillTimePredictor(*single.coefficients, min_samples=min_samples)

    @property
    def fitted(self) -> bool:
        """Enough packs were measured for their own fit to stand."""
        return len(self.own.samples) >= self.own.min_samples

    def predict(self, tokens: int) -> float:
        return (self.own if self.fitted else self.single).predict(tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0:
            self.own.observe(PrefillSample(tokens, 0, seconds))


def packable(req: Request, limits: PackLimits) -> bool:
    """A fresh short prompt: nothing computed anywhere, no token sent yet."""
    return (
        req.state is RequestState.QUEUED
        and req.first_token_s is None
        and req.prompt_tokens <= limits.max_tokens
    )


def choose_pack(
    head: Request,
    worker: WorkerSlot,
    ranked: Sequence[Request],
    placed: Collection[str],
    cost: PackCost,
    estimator: Estimator,
    limits: PackLimits,
    now: float,
) -> list[Request]:
    """The requests to prefill together with ``head``, which was just placed on ``worker``
    (``ranked``: the policy's order; ``placed``: requests placed on some worker now). Empty
    when ``head`` prefills alone."""
    if limits.max_size < 2 or not packable(head, limits):
        return []
    free_slots = worker.kv_slots - worker.held - 1  # the head's slot is not counted yet
    margin = estimator.errors.margin()
    members, tokens, passed = [head], head.prompt_tokens, []
    finish = now + cost.predict(tokens) * (1.0 + margin)  # the pack as it stands
    for req in ranked[ranked.index(head) + 1 :]:
        if req.request_id in placed or not req.waiting:
            continue  # starts elsewhere now (alone or in a pack): not in this worker's line
        if len(members) >= limits.max_size or free_slots < len(members) or req.prefilled:
            break
        if (
            req.tier is not head.tier
            or req.key_id != head.key_id
            or not packable(req, limits)
            or tokens + req.prompt_tokens > limits.max_tokens
        ):
            passed.append(req)  # next in this worker's line after the pack, if it can wait
            continue
        grown = now + cost.predict(tokens + req.prompt_tokens) * (1.0 + margin)
        if not _keeps_deadlines([*members, req], passed, finish, grown, estimator, margin, now):
            break
        members.append(req)
        tokens += req.prompt_tokens
        finish = grown
    return members[1:]


def _keeps_deadlines(
    members: Sequence[Request],
    passed: Sequence[Request],
    finish: float,
    grown: float,
    estimator: Estimator,
    margin: float,
    now: float,
) -> bool:
    """Whether growing the pack (done at ``finish``) into one done at ``grown`` costs no
    request a deadline it makes otherwise: a member one it makes alone, a request passed over
    (it starts once the pack is done) one it makes after the smaller pack."""

    def left(req: Request) -> float:
        return estimator.prefill_left(req, now) * (1.0 + margin)

    done = [(r, now + left(r), grown) for r in members]
    done += [(r, finish + left(r), grown + left(r)) for r in passed]
    return not any(without <= req.deadline_s < with_ for req, without, with_ in done)


# ---------------------------------------------------------------- a pack's records


def start(members: Sequence[Request], worker: WorkerSlot) -> None:
    """Mark a fresh or suspended pack running on ``worker``: its first member holds the
    prefill, the others ride along."""
    ids = tuple(r.request_id for r in members)
    worker.active = ids[0]
    for req in members:
        req.pack = ids
        if req is not members[0]:
            worker.riders[req.request_id] = None


def suspended_siblings(
    req: Request, worker: WorkerSlot, requests: Mapping[str, Request]
) -> list[Request]:
    """The other members of ``req``'s pack whose (shared) state ``worker`` holds: suspended,
    or still stopping (their acknowledgement not in yet). The worker resumes the whole pack it
    stopped, so a member whose acknowledgement comes after the Resume runs too; left out here,
    it would count as suspended while it decodes, and its own Resume later would make the
    worker add a row it already has."""
    siblings = []
    for rid in req.pack:
        sibling = requests.get(rid)
        if rid == req.request_id or sibling is None or sibling.worker_id != worker.worker_id:
            continue
        if rid in worker.suspended or sibling.state is RequestState.PREEMPTING:
            siblings.append(sibling)
    return siblings


def work_left(members: Sequence[Request], cost: PackCost, now: float) -> list[float]:
    """Per member of a pack running on a worker, its part of the pack's predicted prefill
    left: the members' own predictions scaled to the pack's (``cost``: one fixed cost for the
    pack, not one a member), less the time the pack has run since its last report, split in
    proportion to the members' own predictions."""
    single = cost.single
    own = [
        single.predict_partial(r.prompt_tokens, r.tokens_done, r.chunk_end, r.chunk_fraction)
        for r in members
    ]
    total = sum(own)
    if total <= 0:
        return [0.0] * len(members)
    alone = sum(single.predict(r.prompt_tokens) for r in members)
    packed = cost.predict(sum(r.prompt_tokens for r in members))
    run_s = now - max(r.progress_at_s for r in members)
    left = max(0.0, total * packed / alone - run_s)
    return [left * part / total for part in own]


def riders(worker: WorkerSlot, requests: Mapping[str, Request]) -> list[Request]:
    """The members of the running pack other than its first (which holds ``active``)."""
    return [requests[rid] for rid in worker.riders if rid in requests]


def leave(req: Request, worker: WorkerSlot, *, pack_goes_on: bool = False) -> None:
    """``req`` no longer prefills on ``worker``: its first token is out or it stopped (with
    its whole pack), or it was cancelled (``pack_goes_on``: the next member then holds the
    prefill for the rest of its pack)."""
    worker.riders.pop(req.request_id, None)
    if worker.active == req.request_id:
        worker.active = next(iter(worker.riders), None) if pack_goes_on else None
        if worker.active is not None:
            del worker.riders[worker.active]
