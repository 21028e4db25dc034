"""The queue service's worker control stream refuses a worker without KV slots.

Every worker is batched (docs/design.md, "The batched engine"); a worker from before said
``kv_slots`` 0 for "unbatched", which the scheduler no longer has. The refusal comes before
the worker is joined, so no service core is needed here: a real gRPC server and client.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from queue_service.scheduler import WorkerJoined
from queue_service.workers.api import WorkerApi
from tierflow.v1 import worker_pb2, worker_pb2_grpc


def attach_with(hello: worker_pb2.Hello) -> tuple[grpc.StatusCode, str]:
    async def scenario() -> tuple[grpc.StatusCode, str]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerControlServicer_to_server(WorkerApi(core=None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = worker_pb2_grpc.WorkerControlStub(channel).Attach(
                    iter([worker_pb2.WorkerMessage(hello=hello)])
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stream:
                        pass
                return refused.value.code(), refused.value.details()
        finally:
            await server.stop(None)

    return asyncio.run(scenario())


def test_a_worker_without_kv_slots_is_refused_before_it_joins():
    code, details = attach_with(worker_pb2.Hello(worker_id="old", kv_slots=0))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_slots must be >= 1" in details


def test_the_scheduler_has_no_worker_without_kv_slots():
    with pytest.raises(ValueError, match="needs >= 1"):
        WorkerJoined("old", kv_slots=0)
