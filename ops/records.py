"""Where the audit and the compare read requests from, one record at a time (never the whole
source in memory):

* the request log on Kafka (``FinishedRequest`` records of ``<prefix>request_log``), for a time
  window: every partition read from the first offset at or after ``since`` up to the end offset
  it had when reading started (a bounded read, not a tail);
* a request-log dump: JSON lines, one ``FinishedRequest`` per line (``dump_kafka`` writes it);
* a trace file (the Azure CSV or Mooncake JSON lines that ``tierflow bench --trace`` reads):
  arrival times and lengths only; tiers drawn by ``bench.traces``' rule. Read streaming, in file
  order (both public traces are in arrival order).

``progress`` callbacks get (done, total) in the source's own unit (bytes or records).
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from google.protobuf import json_format

from bench.traces import TraceOptions, assign_tier
from queue_service.core.finished import tbt_missed
from tierflow.identity import Identity, Role
from tierflow.kafka_settings import KafkaSettings
from tierflow.v1 import queue_pb2

Progress = Callable[[int, int], None]
DEFAULT_TRACE_OPTIONS = TraceOptions()


@dataclass(frozen=True)
class LogRecord:
    """One request, whatever its source. Times in seconds; ``arrival_s`` is Unix time for the
    request log, seconds from the trace's start for a trace."""

    tier: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    status: str = "done"  # trace records: assumed served
    ttft_s: float | None = None  # None: not known (a trace) or no first token
    tbt_s: float | None = None  # the mean gap between output tokens
    tbt_p99_s: float | None = None  # the p99 of those gaps
    preemptions: int = 0
    deployment: str = ""
    policy: str = ""
    slo_s: float | None = None
    key_id: str = ""
    worker_id: str = ""
    finished_s: float | None = None
    tbt_slo_s: float | None = None  # None: no TBT target, or not known
    # The tier asked for, when admission served it at ``tier`` because the asked one was at
    # capacity; "" when served as asked.
    requested_tier: str = ""

    @classmethod
    def from_proto(cls, m: queue_pb2.FinishedRequest) -> LogRecord:
        return cls(
            tier=m.tier,
            prompt_tokens=m.prompt_tokens,
            output_tokens=m.output_tokens,
            arrival_s=m.arrival_unix_ms / 1000,
            status=m.status,
            ttft_s=m.ttft_ms / 1000 if m.ttft_ms > 0 else None,
            tbt_s=m.tbt_ms / 1000 if m.tbt_ms > 0 else None,
            tbt_p99_s=m.tbt_p99_ms / 1000 if m.tbt_p99_ms > 0 else None,
            preemptions=m.preemptions,
            deployment=m.deployment,
            policy=m.policy,
            slo_s=m.slo_ms / 1000 if m.slo_ms > 0 else None,
            key_id=m.key_id,
            worker_id=m.worker_id,
            finished_s=m.finished_unix_ms / 1000 if m.finished_unix_ms else None,
            tbt_slo_s=m.tbt_slo_ms / 1000 if m.tbt_slo_ms > 0 else None,
            requested_tier=m.requested_tier,
        )

    @property
    def tbt_violated(self) -> bool:
        return tbt_missed(self.status, self.tbt_p99_s or 0.0, self.tbt_slo_s)


# ------------------------------------------------------------------------------ request log


def operator_kafka_from_env(**overrides) -> KafkaSettings:
    """The ops tools' Kafka settings (``KafkaSettings.from_env``): over mTLS, when the
    environment or ``overrides`` name a directory, as the ``operator`` identity (the request
    log is all its ACLs let it read)."""
    return KafkaSettings.from_env(**overrides, tls_identity=Identity(Role.OPERATOR).file_stem)


def iter_kafka(
    settings: KafkaSettings,
    *,
    since_s: float | None = None,
    until_s: float | None = None,
    progress: Progress | None = None,
    poll_timeout_s: float = 1.0,
) -> Iterator[queue_pb2.FinishedRequest]:
    """The request log's records written in [since_s, until_s) (Unix seconds; None: open)."""
    from kafka import KafkaConsumer, TopicPartition

    topic = settings.request_log_topic
    consumer = KafkaConsumer(**settings.consumer_config(standalone=True))
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        starts = _start_offsets(consumer, tps, since_s)
        total = sum(max(0, ends[tp] - starts[tp]) for tp in tps)
        left = {tp for tp in tps if starts[tp] < ends[tp]}
        for tp in tps:
            consumer.seek(tp, starts[tp])
        done = 0
        while left:
            batches = consumer.poll(timeout_ms=int(poll_timeout_s * 1000), max_records=500)
            for tp, batch in batches.items():
                for rec in batch:
                    if rec.offset >= ends[tp]:
                        left.discard(tp)
                        break
                    done += 1
                    if until_s is None or rec.timestamp < until_s * 1000:
                        yield queue_pb2.FinishedRequest.FromString(rec.value)
                if consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
            if progress is not None:
                progress(done, total)
    finally:
        consumer.close(autocommit=False)


def _start_offsets(consumer, tps, since_s: float | None) -> dict:
    if since_s is None:
        return consumer.beginning_offsets(tps)
    found = consumer.offsets_for_times({tp: int(since_s * 1000) for tp in tps})
    ends = consumer.end_offsets(tps)
    return {tp: (found[tp].offset if found.get(tp) else ends[tp]) for tp in tps}


def dump_kafka(settings: KafkaSettings, path: Path, **window) -> int:
    """Write the request log's window to ``path`` as JSON lines; returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for m in iter_kafka(settings, **window):
            f.write(json.dumps(json_format.MessageToDict(m, preserving_proto_field_name=True)))
            f.write("\n")
            n += 1
    return n


def iter_dump(path: Path, progress: Progress | None = None) -> Iterator[queue_pb2.FinishedRequest]:
    for line, _ in _lines(path, progress):
        if line.strip():
            yield json_format.ParseDict(json.loads(line), queue_pb2.FinishedRequest())


# ------------------------------------------------------------------------------------ traces


def iter_trace(
    path: Path, opts: TraceOptions = DEFAULT_TRACE_OPTIONS, progress: Progress | None = None
) -> Iterator[LogRecord]:
    """A trace's requests in file order, with tiers drawn by ``bench.traces.assign_tier`` (on
    the unscaled lengths unless ``opts.length_scale`` says otherwise)."""
    rng = random.Random(opts.seed)
    lines = _lines(path, progress)
    first = next(lines, None)
    if first is None:
        return
    parse = _azure_row(first[0]) if "ContextTokens" in first[0] else None
    if parse is None and not first[0].lstrip().startswith("{"):
        raise ValueError(f"{path}: not an Azure CSV (TIMESTAMP,ContextTokens,...) or JSON lines")
    rows = lines if parse is not None else _chain_first(first, lines)
    t0: float | None = None
    for line, line_no in rows:
        if not line.strip():
            continue
        try:
            at_s, n_in, n_out = parse(line) if parse else _mooncake_row(line)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"{path}:{line_no}: bad trace record ({exc})") from exc
        t0 = at_s if t0 is None else t0
        tokens = max(1, round(n_in * opts.length_scale))
        yield LogRecord(assign_tier(tokens, opts, rng), tokens, n_out, at_s - t0)


def _chain_first(first, rest):
    yield first
    yield from rest


def _azure_row(header: str) -> Callable[[str], tuple[float, int, int]]:
    names = next(csv.reader([header]))
    col = {name.strip(): i for i, name in enumerate(names)}

    def parse(line: str) -> tuple[float, int, int]:
        row = next(csv.reader([line]))
        stamp = row[col["TIMESTAMP"]].strip()
        if "." in stamp:  # seven fractional digits (100 ns): datetime takes at most six
            head, frac = stamp.split(".", 1)
            stamp = f"{head}.{frac[:6]}"
        at = datetime.fromisoformat(stamp).timestamp()
        return at, int(row[col["ContextTokens"]]), int(row[col["GeneratedTokens"]])

    return parse


def _mooncake_row(line: str) -> tuple[float, int, int]:
    obj = json.loads(line)
    return float(obj["timestamp"]) / 1000.0, int(obj["input_length"]), int(obj["output_length"])


def _lines(path: Path, progress: Progress | None) -> Iterator[tuple[str, int]]:
    """(line, line number) of a text file, reporting bytes read every 64k lines."""
    total = Path(path).stat().st_size
    with open(path, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        for line_no, line in enumerate(text, 1):
            yield line, line_no
            if progress is not None and line_no % 65536 == 0:
                progress(raw.tell(), total)
    if progress is not None:
        progress(total, total)


def read_source(
    source: str,
    *,
    settings: KafkaSettings | None = None,
    since_s: float | None = None,
    until_s: float | None = None,
    trace_options: TraceOptions = DEFAULT_TRACE_OPTIONS,
    progress: Progress | None = None,
) -> Iterator[LogRecord]:
    """``kafka`` (the request log), a dump (``*.jsonl`` of FinishedRequest records, told apart
    by their ``tier`` + ``status`` keys) or a trace file."""
    if source == "kafka":
        settings = settings or operator_kafka_from_env()
        window = {"since_s": since_s, "until_s": until_s, "progress": progress}
        return (LogRecord.from_proto(m) for m in iter_kafka(settings, **window))
    path = Path(source)
    if is_request_log_dump(path):
        return (LogRecord.from_proto(m) for m in iter_dump(path, progress))
    return iter_trace(path, trace_options, progress)


def is_request_log_dump(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and "tier" in obj and "status" in obj
