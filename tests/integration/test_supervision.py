"""`tierflow up` supervises its children, and the queue service says when no worker serves.

The local stack (``launch.local_stack``, its own Kafka, no edge, tiny-llama) with a worker and
then the queue service killed: each is restarted, the worker attaches again, health goes
NOT_SERVING while no worker is attached and back, and requests succeed afterwards; every
worker it starts (the restarted one too) has OpenMP threads that sleep rather than spin,
since all of the stack shares the machine's cores. A queue
service with no worker at all tells a waiting client so, then ends the stream UNAVAILABLE.
"""

from __future__ import annotations

import os
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launch.local_stack import LocalStack, StackConfig
from launch.supervisor import RestartPolicy
from tests.integration.load import prompt_ids, run_request, stream_until
from tests.integration.processes import start_queue_service
from tierflow.identity import open_channel


def health(target: str, service: str = "", credentials=None) -> int | None:
    channel = open_channel(target, credentials)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
            return reply.status
        except grpc.RpcError:
            return None


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def omp_wait_policy(proc) -> str | None:
    """OMP_WAIT_POLICY in the environment the child process runs with."""
    return psutil.Process(proc.proc.pid).environ().get("OMP_WAIT_POLICY")


def attaches(proc) -> int:
    return sum(e.get("event") == "attached" for e in proc.log_events())


@pytest.mark.timeout(900)  # two restarts, each reloads torch and a model on a busy CI box
def test_the_stack_restarts_a_killed_worker_and_queue_service(tmp_path):
    serving = health_pb2.HealthCheckResponse.SERVING
    config = StackConfig(
        model="tiny-llama",
        edge=False,
        log_dir=tmp_path / "stack",
        restart=RestartPolicy(min_backoff_s=0.2, max_backoff_s=1.0, poll_s=0.1),
        no_worker_timeout_s=600,  # a restarted worker loads torch and its model first
        tls_dir=tmp_path / "certs",
    )
    with LocalStack(config) as stack:
        target = stack.endpoints.queue_service
        operator = stack.endpoints.operator_credentials()  # every hop is mTLS
        procs = {p.name: p for p in stack.processes}
        worker, queue_service = procs["worker-0"], procs["queue-service"]

        def health_now() -> int | None:
            return health(target, credentials=operator)

        wait_for(lambda: health_now() == serving, 30, "health never SERVING")
        before = run_request(
            target, "critical", "before", prompt_ids(20, seed=1), credentials=operator
        )
        assert before.done
        expected_policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        assert omp_wait_policy(worker) == expected_policy

        worker.proc.kill()
        # No worker: the service says so until the restarted one attaches.
        wait_for(lambda: health_now() != serving, 30, "health stayed SERVING")
        waiting, _ = stream_until(
            target,
            "critical",
            "during",
            prompt_ids(20, seed=2),
            until=lambda k: False,
            credentials=operator,
        )
        wait_for(lambda: attaches(worker) == 2, 180, "the worker was not restarted")
        wait_for(lambda: health_now() == serving, 30, "health did not come back")
        during = waiting.result(timeout=120)
        assert during.done is not None
        assert omp_wait_policy(worker) == expected_policy  # the restarted process's

        queue_service.proc.kill()
        wait_for(lambda: attaches(worker) == 3, 180, "the worker did not reattach")
        wait_for(lambda: health_now() == serving, 30, "health did not come back")
        assert run_request(
            target, "critical", "after", prompt_ids(20, seed=3), credentials=operator
        ).done
        assert stack.supervisor.restarts == 2 and not stack.supervisor.failed.is_set()


def test_a_request_with_no_worker_is_told_so_then_ends_unavailable(tmp_path, kafka_settings):
    qs, target = start_queue_service(
        tmp_path, kafka_settings, model="tiny-llama", extra=["--no-worker-timeout", "2"]
    )
    try:
        assert health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(target, "tierflow.v1.WorkerControl") == health_pb2.HealthCheckResponse.SERVING
        outcome = run_request(target, "critical", "alone", prompt_ids(20, seed=4))
        assert outcome.kinds == ["queued", "waiting", "error"]  # terminal event, then status
        assert outcome.code is grpc.StatusCode.UNAVAILABLE and "no worker" in outcome.details
        assert outcome.seconds >= 2
    finally:
        qs.stop()
