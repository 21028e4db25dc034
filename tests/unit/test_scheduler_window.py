"""The planning window (``waiting_index``) against the full planner, on random event streams.

Each step copies the scheduler and hands the same event to the copy with ``plan_window=None``:
the full planner, today's decisions (every waiting request ranked on every event). The windowed
scheduler's commands must be the reference's wherever its window held every waiting request,
and elsewhere differ only in the ways docs/design.md lists ("The scheduler at fleet scale"):

* ``timers``: only wake-ups differ, for requests outside the window (they keep the wake-up
  they got when indexed, aimed with the error margin of that time);
* ``outside``: the reference starts, or preempts for, a request outside the window;
* ``ranking``: the window's own order differs because the tier guard or fair order saw fewer
  requests ahead (the work ahead of a request counts only the window's).

On the windowed scheduler, after every event: the index holds exactly the requests that wait
for a prefill; a free worker with a KV slot never stays idle while a request is queued; no
request starts while an aged one is queued; a start never passes over a queued, on-time
request of a higher tier due no later than every waiting request of the started one's tier;
every waiting request that can still make its deadline has a wake-up no later than the last
moment it could start and make it.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_service.scheduler import (
    Assign,
    AssignPacked,
    CancelTimer,
    PauseDecode,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    PrefillTimePredictor,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestState,
    Resume,
    Scheduler,
    SchedulerConfig,
    SetTimer,
    TimerFired,
    WorkerJoined,
    WorkerLeft,
)
from queue_service.scheduler.policies import slack_s
from tests.tiers import UNIT_TIERS

TIMER_COMMANDS = (SetTimer, CancelTimer)
IDENTICAL = ("identical", "identical, window partial")


class World:
    """Workers that do what the scheduler's commands say, driven by drawn actions."""

    def __init__(self, window: int, workers: int, kv_slots: int, starvation_s: float) -> None:
        config = SchedulerConfig(plan_window=window, starvation_s=starvation_s)
        predictor = PrefillTimePredictor(a=1e-3, b=0.0, c=0.0)  # 1000 tokens = 1 s
        self.scheduler = Scheduler("flowprefill", UNIT_TIERS, predictor, config)
        self.now = 0.0
        self.seq = 0
        self.drop: dict[str, bool] = {}  # request -> whether its last stop drops its state
        self.kinds: Counter[str] = Counter()
        for i in range(workers):
            self.step(WorkerJoined(f"w{i}", kv_slots=kv_slots, interruption_s=0.01))

    # -- what the workers can report now

    def _in_state(self, state: RequestState) -> list[str]:
        views = (self.scheduler.request(rid) for rid in self.scheduler._requests)
        return sorted(r.request_id for r in views if r is not None and r.state is state)

    def event(self, kind: str, pick: int, value: int):
        s = self.scheduler
        if kind == "arrive":
            self.seq += 1
            tier = UNIT_TIERS.names[value % 3]
            return RequestArrived(
                f"r{self.seq}", tier, 50 + (value * 37) % 900, 4, key_id=f"k{pick % 3}"
            )
        if kind in ("wait", "timer"):
            # Time passes as the dispatcher lets it: a wake-up fires when its time comes.
            until = self.now + value / 200 if kind == "wait" else float("inf")
            armed = s.timers()
            rid = min(armed, key=lambda r: (armed[r], r), default=None)
            if rid is None or armed[rid] > until:
                self.now = until if until != float("inf") else self.now
                return None
            self.now = max(self.now, armed[rid])
            return TimerFired(rid)
        if kind == "leave":
            workers = s.workers
            return WorkerLeft(workers[pick % len(workers)]) if len(workers) > 1 else None
        choices = {
            "progress": RequestState.RUNNING,
            "finish": RequestState.RUNNING,
            "done": RequestState.DECODING,
            "ack": RequestState.PREEMPTING,
        }
        live = self._in_state(choices[kind]) if kind in choices else sorted(s._requests)
        if not live:
            return None
        req = s.request(live[pick % len(live)])
        assert req is not None
        wid = req.worker_id or ""
        if kind == "progress":
            done = min(req.prompt_tokens - 1, req.tokens_done + 1 + value % 200)
            return PrefillProgress(req.request_id, wid, done, chunk_end=done)
        if kind == "finish":
            return PrefillFinished(req.request_id, wid, req.prompt_tokens, req.prompt_tokens / 1e3)
        if kind == "done":
            return RequestDone(req.request_id, wid)
        if kind == "ack":
            dropped = self.drop.get(req.request_id, False)
            return PreemptionAcked(req.request_id, wid, req.tokens_done, dropped, 0.01)
        return RequestCancelled(req.request_id)

    # -- one event on both schedulers

    def step(self, event) -> None:
        s = self.scheduler
        reference = copy.deepcopy(s)
        reference.config = dataclasses.replace(reference.config, plan_window=None)
        before = set(s._index._seq_of) if hasattr(s, "_index") else set()
        decisions = s.counters.get("decisions", 0)
        got = s.handle(event, self.now)
        want = reference.handle(event, self.now)
        decided = s.counters.get("decisions", 0) > decisions
        self.kinds[self.classify(got, want, reference, decided)] += 1
        for command in got:
            if isinstance(command, (Preempt, PauseDecode)):
                self.drop[command.request_id] = command.drop_state
        check_invariants(s, got, before, self.now)

    def classify(self, got, want, reference: Scheduler, decided: bool) -> str:
        planned, covered = self.scheduler.planned()
        if got == want:
            return "identical" if covered or not decided else "identical, window partial"
        assert decided and not covered, (
            f"the window held every waiting request, yet the decision differs:\n"
            f"  windowed:  {got}\n  reference: {want}"
        )
        others = [c for c in got if not isinstance(c, TIMER_COMMANDS)]
        reference_others = [c for c in want if not isinstance(c, TIMER_COMMANDS)]
        if others == reference_others:
            differing = set(got) ^ set(want)
            assert all(c.request_id not in planned for c in differing), (
                f"a wake-up of a planned request differs: {differing}"
            )
            return "timers"
        if any(rid not in planned for rid in _started_or_served(reference_others, reference)):
            return "outside"
        return "ranking"


def _started_or_served(commands, scheduler: Scheduler) -> list[str]:
    """The requests the commands start, and those a preemption among them is for."""
    ids: list[str] = []
    for command in commands:
        if isinstance(command, (Assign, Resume)):
            ids.append(command.request_id)
        elif isinstance(command, AssignPacked):
            ids.extend(command.request_ids)
        elif isinstance(command, (Preempt, PauseDecode)):
            worker = scheduler._workers.get(command.worker_id)
            if worker is not None and worker.reserved_for:
                ids.append(worker.reserved_for)
    return ids


def check_invariants(s: Scheduler, commands, before: set[str], now: float) -> None:
    requests = s._requests
    waits = {rid for rid, r in requests.items() if s._waits(r)}
    assert set(s._index._seq_of) == waits, "the waiting index lost track of a request"
    queued = [r for r in requests.values() if r.state is RequestState.QUEUED]
    idle = [w for w in s._workers.values() if w.free and w.has_kv_slot]
    assert not (queued and idle), f"{idle[0].worker_id} idles while {queued[0].request_id} waits"
    aged = [r for r in queued if now - r.arrival_s >= s.config.starvation_s]
    for command in commands:
        if not isinstance(command, Assign):
            continue
        started = requests.get(command.request_id)
        if started is None or now - started.arrival_s >= s.config.starvation_s:
            continue
        assert not aged, f"{started.request_id} started while aged {aged[0].request_id} waits"
        tier_deadlines = [
            r.deadline_s
            for r in requests.values()
            if r.tier is started.tier and r.request_id in before
        ]
        bar = min([started.deadline_s, *tier_deadlines])
        for q in queued:
            left = s._estimator.prefill_left(q, now)
            passed_over = (
                q.tier.rank < started.tier.rank
                and q.deadline_s <= bar
                and slack_s(q, now, left) >= 0
                and not q.prefilled
            )
            assert not passed_over, f"{started.request_id} started before {q.request_id}"
    margin, switch_s = s.prediction_errors.margin(), s.switch_s()
    timers = s.timers()
    for rid in waits:
        req = requests[rid]
        if req.due or req.prefilled:
            continue
        left = s._estimator.prefill_left(req, now)
        latest = s.policy.latest_start_s(req, now, left, margin, switch_s)
        if latest is not None and latest > now + 0.05 * req.tier.ttft_slo_s:
            assert rid in timers, f"{rid} can still make its deadline but has no wake-up"
            assert timers[rid] <= req.deadline_s - left, f"{rid}'s wake-up comes too late"


KINDS = ("arrive",) * 6 + ("wait", "wait", "progress", "finish", "finish", "done", "done")
KINDS += ("ack", "ack", "timer", "cancel", "leave")
ACTIONS = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 50), st.integers(0, 1000)),
    min_size=10,
    max_size=80,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=ACTIONS,
    window=st.integers(1, 3),
    workers=st.integers(1, 3),
    kv_slots=st.integers(1, 4),
    aging=st.booleans(),
)
def test_windowed_decisions_keep_the_invariants_and_differ_only_as_explained(
    actions, window, workers, kv_slots, aging
):
    world = World(window, workers, kv_slots, starvation_s=2.0 if aging else 300.0)
    for kind, pick, value in actions:
        event = world.event(kind, pick, value)
        if event is not None:
            world.step(event)
    assert set(world.kinds) <= {*IDENTICAL, "timers", "outside", "ranking"}


def test_share_of_identical_commands_on_random_streams():
    """Seeded streams of a few hundred events with the default window (it often holds fewer
    than every waiting request): the share of events whose commands are the reference's,
    and what the rest are."""
    kinds: Counter[str] = Counter()
    for seed in range(12):
        rng = random.Random(seed)
        world = World(SchedulerConfig().plan_window, workers=2, kv_slots=3, starvation_s=300.0)
        for _ in range(300):
            kind = rng.choice(KINDS)
            event = world.event(kind, rng.randrange(51), rng.randrange(1001))
            if event is not None:
                world.step(event)
        kinds += world.kinds
    total = sum(kinds.values())
    print(
        f"\nwindow {SchedulerConfig().plan_window}, {total} events: "
        + ", ".join(f"{k} {n}" for k, n in kinds.most_common())
    )
    same = sum(kinds[k] for k in IDENTICAL)
    assert same / total >= 0.9, kinds
    assert kinds["identical, window partial"] >= 0.2 * total, "the window mostly held every request"


def test_a_request_behind_the_window_preempts_at_its_wake_up():
    """The difference ``outside`` in one case: the flood key's second request (f1) would
    preempt its own key's running prefill (f0) to make its deadline; the calm key's request,
    due as soon, holds the head of every order of the tier, so the window of 1 does not hold
    f1. It waits on its wake-up, the last moment the preemption still saves it, and preempts
    then; the full planner preempts at once."""
    config = SchedulerConfig(plan_window=1)
    predictor = PrefillTimePredictor(a=1e-3, b=0.0, c=0.0)
    s = Scheduler("flowprefill", UNIT_TIERS, predictor, config)
    s.handle(WorkerJoined("w0", kv_slots=4), 0.0)
    s.handle(RequestArrived("f0", "critical", 250, key_id="flood", arrival_s=0.0), 0.0)
    s.handle(RequestArrived("calm", "critical", 100, key_id="calm", arrival_s=-0.8), 0.01)
    reference = copy.deepcopy(s)
    reference.config = dataclasses.replace(config, plan_window=None)
    arrival = RequestArrived("f1", "critical", 100, key_id="flood", arrival_s=-0.8)
    assert [c for c in reference.handle(arrival, 0.02) if isinstance(c, Preempt)]
    commands = s.handle(arrival, 0.02)
    assert not [c for c in commands if isinstance(c, Preempt)]
    (wake_up,) = [c for c in commands if isinstance(c, SetTimer) and c.request_id == "f1"]
    assert wake_up.at_s < 0.2 - 0.1  # f1's deadline less its prefill
    commands = s.handle(TimerFired("f1"), wake_up.at_s)
    assert [c.request_id for c in commands if isinstance(c, Preempt)] == ["f0"]
