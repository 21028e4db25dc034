"""Replaying a workload through the running services (Envoy or a queue service) over gRPC.

Each arrival is sent at its time on the wall clock from a thread of its own, with the
credentials of its tier (an API key through the edge, the trusted tier header directly). The
client measures TTFT itself (send -> first-token event) and keeps the server's timings, so the
results fill the same ``RequestRecord``s as the in-process harness and go through the same
``bench.metrics.summarise``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from bench.harness import RequestRecord, RunResult
from bench.workload import Arrival, Workload
from tierflow.client import TierflowClient


@dataclass(frozen=True)
class Credentials:
    """How a tier's requests identify themselves: ``api_key`` (edge) or ``tier`` (direct, with
    the operator's mTLS identity as ``channel``: ``Endpoints.operator_credentials``)."""

    api_key: str | None = None
    tier: str | None = None
    channel: grpc.ChannelCredentials | None = None


@dataclass
class StackRecord(RequestRecord):
    text: str = ""
    server_ttft_ms: float = 0.0
    deployment: str = ""  # the side of a rollout that admitted it (its Queued event says)


def replay(
    target: str,
    workload: Workload,
    prompt_of: Callable[[Arrival], Sequence[int]],
    credentials: Callable[[str], Credentials],
    *,
    policy: str = "flowprefill",
    timeout_s: float = 600.0,
    on_progress: Callable[[], None] = lambda: None,
    max_threads: int = 64,
    stop: Callable[[dict[str, StackRecord]], bool] = lambda sent: False,
) -> RunResult:
    """Sends every arrival at its time, or until ``stop(records sent so far)`` says so (checked
    before each; the arrivals not sent are left out of the result), then waits for the ones
    sent."""
    records: dict[str, StackRecord] = {}
    clients: dict[str, TierflowClient] = {}
    lock = threading.Lock()

    def client_for(tier: str) -> TierflowClient:
        with lock:
            if tier not in clients:
                creds = credentials(tier)
                clients[tier] = TierflowClient(
                    target, api_key=creds.api_key, tier=creds.tier, credentials=creds.channel
                )
            return clients[tier]

    def send(arrival: Arrival) -> None:
        record = records[arrival.request_id]
        prompt = list(prompt_of(arrival))
        client = client_for(arrival.tier)
        record.arrived_at = time.perf_counter()
        try:
            for event in client.generate(
                prompt, max_new_tokens=arrival.max_new_tokens, timeout=timeout_s
            ):
                kind = event.WhichOneof("event")
                if kind == "queued":
                    record.deployment = event.queued.deployment
                elif kind == "first_token":
                    record.first_token_at = time.perf_counter()
                    record.first_token = event.first_token.token_id
                    record.server_ttft_ms = event.first_token.ttft_ms
                elif kind == "done":
                    record.done_at = time.perf_counter()
                    record.text = event.done.text
                    record.preemptions = event.done.timings.preemptions
                    record.busy_s = event.done.timings.prefill_ms / 1000
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                record.rejected = exc.details() or "rejected"
            else:
                record.failed = f"{exc.code().name}: {exc.details()}"
        finally:
            on_progress()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_threads) as pool:
        futures = []
        for arrival in workload.arrivals:
            delay = start + arrival.at_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if stop(records):
                break
            records[arrival.request_id] = StackRecord(arrival)
            futures.append(pool.submit(send, arrival))
        for f in futures:
            f.result()
    for client in clients.values():
        client.close()
    result = RunResult(policy, records)
    result.makespan_s = time.perf_counter() - start
    result.busy_s = sum(r.busy_s for r in records.values())  # prefill time, as the server saw it
    return result
