"""`tierflow misses LOG`: what each request of a tier that missed its TTFT SLO waited for.

Reads a replay's timeline (``bench.event_log``). Per request of the tier, from its arrival to
its first token: how long until it was assigned, the preemptions made meanwhile and how long
each took to be acknowledged, the decode steps that ran (how many were slotted into a
prefill, and their seconds), its own prefill's engine time, and which requests got their first
token before it, the process's garbage collections and the machine's CPU steal meanwhile
(``bench.cpu_steal``). The misses
first, slowest first; the rest of the tier's slowest after them; then the mean steal during
the misses against that during the tier's other requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.cpu_steal import mean_over
from bench.event_log import read
from bench.tables import print_table


@dataclass(frozen=True)
class Wait:
    request_id: str
    prompt_tokens: int
    ttft_s: float
    to_assign_s: float | None  # arrival to its assignment (None: never assigned)
    own_prefill_s: float  # its prefill's engine time (a pack's, when packed)
    packed: bool
    steps: int  # decode steps that ended between its arrival and its first token
    slotted_steps: int
    step_s: float
    preempt_acks_s: tuple[float, ...]  # Preempt to acknowledgement, of those made meanwhile
    first_before: tuple[str, ...]  # requests whose first token came out meanwhile
    steal: float | None = None  # the CPU steal share meanwhile (None: the log has no samples)
    gc_s: float = 0.0  # the process's garbage collections logged meanwhile (they hold it all)


def waits(records: list[dict], tier: str) -> list[Wait]:
    """One ``Wait`` per request of ``tier`` that got its first token."""
    firsts: dict[str, dict] = {}
    for r in records:
        if r["kind"] == "event" and r["event"] == "FirstToken":
            firsts.setdefault(r["request_id"], r)
    arrivals = [r for r in records if r["kind"] == "arrive" and r["tier"] == tier]
    steal = [(r["t"], r["seconds"], r["steal"]) for r in records if r["kind"] == "cpu"]
    return [
        _wait(records, arrival, firsts[arrival["request_id"]], steal)
        for arrival in arrivals
        if arrival["request_id"] in firsts
    ]


def _wait(records: list[dict], arrival: dict, first: dict, steal: list) -> Wait:
    rid, start, end = arrival["request_id"], arrival["at"], first["at"]
    inside = [r for r in records if start <= _time(r) <= end]
    assigned = next(
        (
            r["t"]
            for r in inside
            if r["kind"] == "command" and r["command"].startswith("assign")
            and rid in r["request_ids"]
        ),
        None,
    )  # fmt: skip
    steps = [r for r in inside if r["kind"] == "event" and r["event"] == "DecodeStepDone"]
    acks = [r for r in inside if r["kind"] == "event" and r["event"] == "Preempted"]
    return Wait(
        rid,
        arrival["prompt_tokens"],
        end - start,
        None if assigned is None else assigned - start,
        first["prefill_busy_s"],
        first.get("pack_size", 0) > 0,
        len(steps),
        sum(1 for s in steps if s["slotted"]),
        sum(s["seconds"] for s in steps),
        tuple(a["at"] - a["signalled_at"] for a in acks),
        tuple(
            r["request_id"]
            for r in inside
            if r["kind"] == "event" and r["event"] == "FirstToken" and r["request_id"] != rid
        ),
        mean_over(steal, start, end),
        sum(r["seconds"] for r in inside if r["kind"] == "gc"),
    )


def _time(record: dict) -> float:
    """When it happened: an arrival's due time, an event's engine time, a command's (or an
    admission's) log time."""
    return record["at"] if record["kind"] in ("arrive", "event") else record["t"]


LAST = "first tokens before it"
COLUMNS = ("request", "prompt", "TTFT ms", "to assign ms", "own prefill ms",
           "decode steps (slotted) ms", "preempt acks ms", "GC ms", "CPU steal", LAST)  # fmt: skip


def report(path: Path, tier: str, slo_s: float, console: Console, slowest: int = 5) -> list[Wait]:
    """Print the misses of ``tier`` (and its ``slowest`` other requests); return the misses."""
    all_waits = sorted(waits(read(path), tier), key=lambda w: -w.ttft_s)
    missed = [w for w in all_waits if w.ttft_s > slo_s]
    shown = missed + [w for w in all_waits if w.ttft_s <= slo_s][:slowest]
    table = Table(title=f"{tier}: {len(missed)} of {len(all_waits)} past {slo_s * 1000:.0f} ms")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("request", LAST) else "right")
    for w in shown:
        table.add_row(
            w.request_id + (" (miss)" if w.ttft_s > slo_s else ""),
            str(w.prompt_tokens),
            f"{w.ttft_s * 1000:.0f}",
            "-" if w.to_assign_s is None else f"{w.to_assign_s * 1000:.0f}",
            f"{w.own_prefill_s * 1000:.0f}" + (" (pack)" if w.packed else ""),
            f"{w.steps} ({w.slotted_steps}) {w.step_s * 1000:.0f}",
            " ".join(f"{a * 1000:.0f}" for a in w.preempt_acks_s) or "-",
            f"{w.gc_s * 1000:.0f}",
            _percent(w.steal),
            " ".join(w.first_before) or "-",
        )
    print_table(console, table)
    met = [w for w in all_waits if w.ttft_s <= slo_s]
    console.print(
        f"mean CPU steal: {_percent(_mean_steal(missed))} during the {len(missed)} misses, "
        f"{_percent(_mean_steal(met))} during the {len(met)} others"
    )
    return missed


def _mean_steal(waits_: list[Wait]) -> float | None:
    shares = [w.steal for w in waits_ if w.steal is not None]
    return sum(shares) / len(shares) if shares else None


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"
