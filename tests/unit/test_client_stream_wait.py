"""What a client stream waits for between events (``ClientApi._next_item``): the next event, a
heartbeat after a silent interval, or the end of its deadline, whichever comes first."""

from __future__ import annotations

import asyncio
import time

from queue_service.clients.api import HEARTBEAT, ClientApi
from tierflow.v1 import serving_pb2


def test_a_silent_stream_gets_a_heartbeat_and_an_event_wins_over_it():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        first = await ClientApi._next_item(queue, None, 0.05)
        event = serving_pb2.GenerateEvent(request_id="r")
        queue.put_nowait(event)
        second = await ClientApi._next_item(queue, None, 0.05)
        return first, second, event

    first, second, event = asyncio.run(scenario())
    assert first is HEARTBEAT
    assert second is event


def test_the_deadline_ends_the_wait_when_it_comes_before_the_heartbeat():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        soon = await ClientApi._next_item(queue, time.monotonic() + 0.05, 10.0)
        later = await ClientApi._next_item(queue, time.monotonic() + 10.0, 0.05)
        return soon, later

    soon, later = asyncio.run(scenario())
    assert soon is None  # the deadline passed: the stream ends
    assert later is HEARTBEAT  # the deadline is far: a heartbeat first
