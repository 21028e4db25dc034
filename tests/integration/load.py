"""Client load for the fault suite and what it must show afterwards: no request lost, none run
twice, each token streamed once.

``Load`` sends requests from a few client threads (each request a fresh stream with its own
request id) and records what each client saw. ``check_exactly_once`` then holds the record
against the workers' logs: every request told ``Queued`` ended with ``Done`` (none lost), its
streamed tokens are exactly its completion (each token once), no worker finished it twice, and a
request refused before ``Queued`` never reached a worker.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from launch.processes import ServiceProcess
from tierflow.client import generate_request
from tierflow.identity import open_channel
from tierflow.tiers import API_KEY_HEADER, TIER_HEADER
from tierflow.v1 import serving_pb2, serving_pb2_grpc


@dataclass
class Outcome:
    request_id: str
    tier: str
    sent_at: float
    ended_at: float = 0.0
    kinds: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # streamed: first token, then tokens
    done: serving_pb2.Done | None = None
    code: grpc.StatusCode | None = None  # the error status, None when it ended with Done
    details: str = ""

    @property
    def queued(self) -> bool:
        return "queued" in self.kinds

    @property
    def seconds(self) -> float:
        return self.ended_at - self.sent_at


def prompt_ids(n: int, seed: int, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(n)]


def plain_stream(
    target: str, *, tier: str | None, api_key: str | None, timeout, prompt, credentials=None,
    **params,
):  # fmt: skip
    """The events of one Generate call on the generated stub, as any gRPC client makes it: no
    retry, no reattach (what the fault cases must hold for, whatever ``tierflow.client`` adds).
    ``credentials``: mTLS (an identity's channel credentials); None: plaintext.
    """
    metadata = [(TIER_HEADER, tier)] if tier else []
    metadata += [(API_KEY_HEADER, api_key)] if api_key else []
    channel = open_channel(target, credentials)
    with channel:
        call = serving_pb2_grpc.TierflowStub(channel).Generate(
            generate_request(prompt, **params), metadata=metadata, timeout=timeout
        )
        try:
            yield from call
        finally:
            call.cancel()


def record_event(outcome: Outcome, event) -> None:
    """Add one stream event to ``outcome``: its kind, its token, or the done."""
    kind = event.WhichOneof("event")
    outcome.kinds.append(kind)
    if kind in ("first_token", "token"):
        outcome.tokens.append(getattr(event, kind).token_id)
    elif kind == "done":
        outcome.done = event.done


def run_request(
    target: str,
    tier: str,
    request_id: str,
    prompt: list[int],
    *,
    max_new_tokens: int = 2,
    timeout: float = 120.0,
    credentials=None,
) -> Outcome:
    """One Generate stream to its end; never raises for a status (it is recorded)."""
    outcome = Outcome(request_id, tier, time.monotonic())
    try:
        for event in plain_stream(
            target, tier=tier, api_key=None, timeout=timeout, prompt=prompt,
            request_id=request_id, max_new_tokens=max_new_tokens, credentials=credentials,
        ):  # fmt: skip
            record_event(outcome, event)
    except grpc.RpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""
    outcome.ended_at = time.monotonic()
    return outcome


class Load:
    """Requests sent at a steady rate from a pool of client threads, until ``stop()``."""

    def __init__(
        self,
        target: str,
        *,
        rate_per_s: float = 2.0,
        tiers: Iterable[str] = ("critical", "standard", "batch"),
        prompt_tokens: tuple[int, int] = (16, 96),
        max_new_tokens: int = 3,
        prefix: str = "load",
        clients: int = 8,
        timeout: float = 120.0,
        credentials=None,
    ) -> None:
        """``credentials``: the clients' mTLS identity (``processes.operator``); None: plaintext."""
        self.target = target
        self.credentials = credentials
        self.interval_s = 1.0 / rate_per_s
        self.tiers = itertools.cycle(tiers)
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.prefix = prefix
        self.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._futures: list[concurrent.futures.Future[Outcome]] = []
        self._request_ids: dict[concurrent.futures.Future[Outcome], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._rng = random.Random(prefix)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _send(self) -> None:
        for i in itertools.count():
            if self._stop.wait(self.interval_s if i else 0):
                return
            n = self._rng.randint(*self.prompt_tokens)
            request_id = f"{self.prefix}-{i}"
            future = self._pool.submit(
                run_request,
                self.target,
                next(self.tiers),
                request_id,
                prompt_ids(n, seed=i),
                max_new_tokens=self.max_new_tokens,
                timeout=self.timeout,
                credentials=self.credentials,
            )
            self._futures.append(future)
            self._request_ids[future] = request_id

    def stop(self, wait_s: float = 180.0) -> list[Outcome]:
        """Stop sending; every request sent so far to its end."""
        self._stop.set()
        self._thread.join()
        done, pending = concurrent.futures.wait(self._futures, timeout=wait_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        stuck = [self._request_ids[f] for f in self._futures if f in pending]  # oldest first
        assert not pending, f"{len(pending)} requests still streaming after {wait_s} s: {stuck[:8]}"
        return sorted((f.result() for f in done), key=lambda o: o.sent_at)


def worker_events(workers: Iterable[ServiceProcess], event: str) -> Counter[str]:
    """How many times each request id has ``event`` in the workers' logs, all together."""
    counts: Counter[str] = Counter()
    for worker in workers:
        for e in worker.log_events():
            if e.get("event") == event and "request_id" in e:
                counts[e["request_id"]] += 1
    return counts


def check_exactly_once(outcomes: list[Outcome], workers: Iterable[ServiceProcess]) -> None:
    """No request lost, none run twice, each token streamed once (see the module docstring)."""
    workers = list(workers)
    finished = worker_events(workers, "finished")
    assigned = worker_events(workers, "assigned")
    for o in outcomes:
        if o.queued:
            assert o.done is not None, f"{o.request_id} was queued, then lost: {o.code} {o.details}"
        if o.done is not None:
            assert o.kinds.count("first_token") <= 1, (o.request_id, o.kinds)
            assert len(o.tokens) == o.done.usage.completion_tokens, (o.request_id, o.kinds)
            assert finished[o.request_id] <= 1, f"{o.request_id} finished {finished[o.request_id]}x"
        elif not o.queued:  # refused before it was queued: no worker ever saw it
            assert assigned[o.request_id] == 0, f"{o.request_id} refused yet ran"


def stream_until(
    target: str, tier: str | None, request_id: str, prompt, *, until, api_key=None, **params
):
    """Starts a request on a thread; returns (the thread's future outcome, an event set once
    ``until(kinds)`` held for the events seen so far)."""
    reached = threading.Event()
    outcome = Outcome(request_id, tier, time.monotonic())

    def run() -> Outcome:
        timeout = params.pop("timeout", None)
        try:
            for event in plain_stream(
                target, tier=tier, api_key=api_key, timeout=timeout, prompt=prompt,
                request_id=request_id, **params,
            ):  # fmt: skip
                record_event(outcome, event)
                if until(outcome.kinds):
                    reached.set()
        except grpc.RpcError as exc:
            outcome.code, outcome.details = exc.code(), exc.details() or ""
        outcome.ended_at = time.monotonic()
        reached.set()
        return outcome

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future, reached


def holder_of(workers, request_id: str):
    """The worker that was assigned ``request_id`` last."""
    for worker in workers:
        if any(
            e.get("event") == "assigned" and e.get("request_id") == request_id
            for e in worker.log_events()
        ):
            return worker
    raise AssertionError(f"no worker was assigned {request_id}")
