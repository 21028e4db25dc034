"""The worker's configuration: one frozen dataclass per part, the single home of its defaults.

``EngineConfig`` configures the prefill engine, ``WorkerConfig`` the worker process (its engine
settings default to the engine's). The worker's command line (``worker.cli``), the benchmarks
and the local stack read their defaults from here. No torch: a launcher can read the defaults
without loading the model stack.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from tierflow.catalogue import DEFAULT_MODEL
from tierflow.metrics import DEFAULT_DEPLOYMENT, METRICS_LOOPBACK

CheckGranularity = Literal["block", "half", "layer", "chunk", "none"]
CHECK_GRANULARITIES: tuple[CheckGranularity, ...] = get_args(CheckGranularity)


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int | None = 2048  # None: the whole prompt is one chunk
    # Where a prefill reads the preemption channel: "block" (between row blocks that each fit
    # ``preempt_budget_ms``, and at every half and layer boundary), "half" (also between a
    # layer's attention and MLP), "layer", "chunk" (at chunk ends only, the chunked baseline),
    # "none" (never).
    check: CheckGranularity = "block"
    # The longest a preemption may wait for the next interruption point (worker.row_blocks):
    # each operator of a prefill runs over blocks of rows that the engine sizes, from the times
    # it measures, to fit this. 25 ms is a twelfth of the critical tier's 0.3 s TTFT SLO: the
    # wait stays a small part of the SLO, while blocks of a 2048-token chunk on a 2-core CPU
    # stay hundreds of rows, large enough for efficient products (docs/results.md measures the
    # slowdown). A hooked prefill (decode slotted in) uses the same blocks whatever the check.
    # None: operators run whole.
    preempt_budget_ms: float | None = 25.0
    block_rows: int | None = None  # a fixed block size instead of the timed one (tests)
    memory_cap_bytes: int = 4 << 30  # for all suspended tasks together
    max_new_tokens_limit: int = 4096
    max_run_ahead_layers: int = 2  # CUDA only; see worker.run_ahead
    # Report progress every this many layers inside a chunk (0: at chunk ends only), so the
    # scheduler's estimate of a long chunk is corrected while it runs. A report is one
    # listener call (~1 us) per 100+ ms layer on a CPU; on a GPU the host runs ahead of the
    # device, so a report says the layer was queued, not finished.
    progress_every_layers: int = 1
    # ... and at most once every this many ms. On a GPU a layer takes 1-2 ms: a report per layer
    # is 500 a second per worker, each an event its queue service decodes and schedules (two
    # thirds of an instance's events in `tierflow bench --scale`), while the scheduler decides
    # on progress at most every 20 ms and extrapolates between reports. On a CPU a layer takes
    # longer than this and every one is reported. 0: no limit.
    progress_interval_ms: float = 5.0

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive (or None), got {self.chunk_size}")
        if self.check not in CHECK_GRANULARITIES:
            raise ValueError(
                f"check must be one of {', '.join(CHECK_GRANULARITIES)}, got {self.check!r}"
            )
        if self.memory_cap_bytes < 0:
            raise ValueError("memory_cap_bytes must be >= 0")
        if self.progress_every_layers < 0:
            raise ValueError("progress_every_layers must be >= 0")
        if not self.progress_interval_ms >= 0:
            raise ValueError(f"progress_interval_ms must be >= 0, got {self.progress_interval_ms}")
        if self.preempt_budget_ms is not None and not self.preempt_budget_ms > 0:
            raise ValueError(
                f"preempt_budget_ms must be > 0 (or None), got {self.preempt_budget_ms}"
            )
        if self.block_rows is not None and self.block_rows <= 0:
            raise ValueError(f"block_rows must be positive (or None), got {self.block_rows}")


@dataclass(frozen=True)
class BatchConfig:
    """The batched engine (``worker.batch_engine``): KV pool and decode batch sizes."""

    max_batch_size: int = 16  # decoding requests in one step
    pool_slots: int = 24  # KV slots: every admitted request (prefilling, decoding, paused) owns one
    slot_tokens: int | None = None  # tokens per slot (prompt + new); None: the model's context
    # Commit the whole pool's memory when the engine starts (a CPU pool is otherwise committed
    # by the OS as requests write it, and handed back as they finish: worker.kv_pool), so a
    # machine short of it fails at start rather than mid-run.
    preallocate: bool = False
    # A lazy pool hands freed slots' memory back once the engine has been idle this long, not
    # as each request ends: a busy worker keeps its pages committed, so compacting the batch
    # never copies into pages the OS has to fault in (worker.kv_pool). Long enough that the
    # gaps between requests at moderate load keep them; short against an operator's glance.
    kv_release_idle_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kv_release_idle_s < 0:
            raise ValueError(f"kv_release_idle_s must be >= 0, got {self.kv_release_idle_s}")
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.pool_slots <= 0:
            raise ValueError(f"pool_slots must be >= 1, got {self.pool_slots}")
        if self.max_batch_size > self.pool_slots:
            raise ValueError(
                f"max_batch_size ({self.max_batch_size}) cannot exceed pool_slots "
                f"({self.pool_slots}): every decoding request owns a slot"
            )
        if self.slot_tokens is not None and self.slot_tokens <= 0:
            raise ValueError(f"slot_tokens must be >= 1 (or None), got {self.slot_tokens}")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    queue_service: str  # host:port of the queue service's WorkerControl server
    worker_id: str = field(default_factory=_default_worker_id)
    model: str = DEFAULT_MODEL  # preset, local directory or hub id (worker.models.load_model)
    device: str | None = None  # None: CUDA when available, else CPU
    chunk_size: int | None = EngineConfig.chunk_size
    check: CheckGranularity = EngineConfig.check
    memory_cap_bytes: int = EngineConfig.memory_cap_bytes  # all suspended requests together
    preempt_budget_ms: float | None = EngineConfig.preempt_budget_ms
    progress_interval_ms: float = EngineConfig.progress_interval_ms
    heartbeat_interval_s: float = 0.5
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 5.0
    # On SIGTERM the worker takes no new request and finishes what it holds, for at most this
    # long; then it stops, and what it still holds reruns elsewhere. Under the grace period its
    # orchestrator gives it (Kubernetes: terminationGracePeriodSeconds, 30 s by default).
    drain_timeout_s: float = 25.0
    deployment: str = DEFAULT_DEPLOYMENT  # the label of its metrics
    metrics_port: int | None = None  # Prometheus /metrics; None: not served, 0: a free port
    # Where /metrics listens: loopback unless the deployment opens it (compose: its network).
    metrics_host: str = METRICS_LOOPBACK
    # The gRPC health service for probes (``worker.health``); None: not served, 0: a free port.
    health_port: int | None = None
    health_host: str = METRICS_LOOPBACK  # loopback unless the deployment opens it
    # KV slots (worker.batch_engine): the worker prefills one request while the others
    # decode together. 1 (with a batch of 1): one request at a time, on the same engine.
    kv_slots: int = BatchConfig.pool_slots
    # Rows of one decode step; None: BatchConfig's default, at most kv_slots.
    max_batch_size: int | None = None
    # Tokens (prompt + new) one request may hold; None: the model's context.
    slot_tokens: int | None = None
    # The whole KV pool's memory committed at start (BatchConfig.preallocate).
    preallocate_kv: bool = False
    # The CPU cores the worker runs on, with one torch thread each; None: every core, torch's
    # default threads. Two workers on one machine each get their own cores, or their products
    # contend for the same ones and each runs at the other's pace.
    cpus: tuple[int, ...] | None = None
    # mTLS: the CA and this worker's identity (``tierflow certs --worker <id>``), which names
    # its worker id; None: plaintext, for development only (``--plaintext``).
    tls_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.queue_service:
            raise ValueError("queue_service address is empty")
        if not self.worker_id:
            raise ValueError("worker_id is empty")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError(
                "need 0 < reconnect_min_s <= reconnect_max_s, got "
                f"{self.reconnect_min_s} and {self.reconnect_max_s}"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"cpus must be core numbers >= 0, got {self.cpus}")
        if self.kv_slots < 1:
            raise ValueError(
                f"kv_slots must be >= 1 (1: one request at a time), got {self.kv_slots}"
            )
        self.batch_config()  # validates the batch and pool sizes now, with a clear error

    def batch_config(self) -> BatchConfig:
        """The engine's KV pool and decode batch sizes."""
        default = min(BatchConfig.max_batch_size, self.kv_slots)
        size = default if self.max_batch_size is None else self.max_batch_size
        return BatchConfig(
            size,
            pool_slots=self.kv_slots,
            slot_tokens=self.slot_tokens,
            preallocate=self.preallocate_kv,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            chunk_size=self.chunk_size,
            check=self.check,
            memory_cap_bytes=self.memory_cap_bytes,
            preempt_budget_ms=self.preempt_budget_ms,
            progress_interval_ms=self.progress_interval_ms,
        )
