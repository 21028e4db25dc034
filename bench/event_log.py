"""A replay's timeline, one JSON line per step: where a request's milliseconds went.

``tierflow bench --event-log DIR`` writes one file per policy run: every arrival (with the time
it was due), every command the dispatcher gave a worker (assign, preempt, pause, resume,
cancel) and every event a runner emitted (progress, first token, decode step, preemption
acknowledged, done), each with its ``perf_counter`` time; once a second the machine's CPU
steal over that second (``bench.cpu_steal``); and every garbage collection of the process that
took at least ``GC_LOGGED_S`` (one holds every thread, the engine's too). ``bench.misses``
reads it back and says, per request that missed its SLO, what it waited for.

Fields: ``t`` (when it was logged), ``kind`` (``arrive`` / ``admit`` / ``command`` / ``event``
/ ``cpu`` / ``gc``), and then the arrival's fields; where admission put it (with a tier's
overflow rule: ``bench --flood``) and each rule's prediction; ``command`` and ``request_ids``;
``event`` (the runner event's class) and its fields, whose own ``at`` is when the engine thread
made it; or ``steal`` and ``seconds`` (the share of the ``seconds`` before ``t``); or
``generation`` and ``seconds`` of a collection that ended at ``t``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
from pathlib import Path
from typing import IO, Any

from bench.cpu_steal import StealSampler
from tierflow.heap import watch_collections

GC_LOGGED_S = 0.001


class EventLog:
    def __init__(self, path: Path, steal_interval_s: float = 1.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()  # the steal sampler writes from its own thread
        self._sampler = StealSampler(self.cpu, steal_interval_s)
        # Collections end in whichever thread ran them, maybe inside ``_write``: kept here,
        # written with the next record.
        self._collections: list[dict] = []
        self._watch = watch_collections(self._on_collection)

    def _on_collection(self, generation: int, seconds: float) -> None:
        if seconds >= GC_LOGGED_S:
            self._collections.append(
                {"t": time.perf_counter(), "kind": "gc", "generation": generation,
                 "seconds": seconds}
            )  # fmt: skip

    def cpu(self, steal: float, seconds: float) -> None:
        self._write("cpu", steal=steal, seconds=seconds)

    def arrival(self, request_id: str, tier: str, prompt_tokens: int, due_at: float) -> None:
        self._write("arrive", request_id=request_id, tier=tier, prompt_tokens=prompt_tokens,
                    at=due_at)  # fmt: skip

    def admission(self, request_id: str, placement: Any) -> None:
        """Where admission put a request (``capacity_board.Placement``) and the predictions
        each rule judged it by."""
        verdicts = [*placement.verdicts, *([placement.admitting] if placement.admitting else [])]
        self._write("admit", request_id=request_id, requested=placement.requested_tier,
                    served=placement.served_tier,
                    verdicts=[dataclasses.asdict(v) for v in verdicts])  # fmt: skip

    def command(self, command: str, request_ids: list[str]) -> None:
        self._write("command", command=command, request_ids=request_ids)

    def event(self, event: Any) -> None:
        fields = {
            f.name: _plain(getattr(event, f.name))
            for f in dataclasses.fields(event)
            if f.name not in ("tokens", "output_ids", "resume_point")
        }
        self._write("event", event=type(event).__name__, **fields)

    def _write(self, kind: str, **fields: Any) -> None:
        record = {"t": time.perf_counter(), "kind": kind, **fields}
        with self._lock:
            self._write_collections()
            self._file.write(json.dumps(record) + "\n")

    def _write_collections(self) -> None:
        while self._collections:
            self._file.write(json.dumps(self._collections.pop(0)) + "\n")

    def close(self) -> None:
        self._sampler.stop()
        gc.callbacks.remove(self._watch)
        with self._lock:
            self._write_collections()
            self._file.close()


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def read(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]
