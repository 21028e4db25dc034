"""Usage metering: ``tierflow usage`` — who used how much, at which tier, from the request log.

One row per API key (its label, never the key) and tier that served its requests: requests,
prompt and output tokens, requests done within their SLO, requests downgraded into that tier
(asked for a higher one that was at capacity), and requests refused for load (the tier's
overflow rule ``reject``, or shedding). Tokens are those of the requests that completed
(``done``), as ``tierflow_tokens_total`` counts them; a refused request is billed nothing and
is counted so that a customer's refusals are visible.

The rows are what a billing system takes in: ``write_csv`` and ``write_json`` give the same
rows, totals last.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ops.records import LogRecord

REFUSED = ("shed",)  # refused for load: at admission (overflow rule, shedding) or on arrival


@dataclass
class UsageRow:
    key: str  # the key's label ("" for requests that did not come through the edge)
    served_tier: str
    requests: int = 0
    done: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    slo_met: int = 0
    downgraded: int = 0  # asked for a higher tier that was at capacity, served at this one
    refused: int = 0

    def add(self, record: LogRecord) -> None:
        self.requests += 1
        done = record.status == "done"
        self.done += done
        self.prompt_tokens += record.prompt_tokens if done else 0
        self.output_tokens += record.output_tokens if done else 0
        self.slo_met += _slo_met(record)
        self.downgraded += bool(record.requested_tier)  # set only when it differs from tier
        self.refused += record.status in REFUSED


def _slo_met(record: LogRecord) -> bool:
    return (
        record.status == "done"
        and record.ttft_s is not None
        and record.slo_s is not None
        and record.ttft_s <= record.slo_s
    )


def usage_rows(records: Iterable[LogRecord]) -> list[UsageRow]:
    """Per key and served tier, sorted by key then tier; a ``*`` row of all keys per tier and
    a ``*`` / ``*`` total close the list."""
    rows: dict[tuple[str, str], UsageRow] = {}
    for record in records:
        for key in ((record.key_id, record.tier), ("*", record.tier), ("*", "*")):
            rows.setdefault(key, UsageRow(*key)).add(record)
    return sorted(rows.values(), key=_row_order)


def _row_order(row: UsageRow) -> tuple:
    """Keys in order, the all-keys rows after them; each key's tiers in order, "*" last."""
    return (row.key == "*", row.key, row.served_tier == "*", row.served_tier)


COLUMNS = tuple(f.name for f in fields(UsageRow))


def write_csv(rows: list[UsageRow], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    return path


def write_json(rows: list[UsageRow], path: Path, *, window: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"window": window, "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return path


def render(rows: list[UsageRow], console) -> None:
    from rich.table import Table

    table = Table(title="usage per key and served tier (refused: for load; never billed)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("key", "served_tier") else "right")
    for row in rows:
        table.add_row(*(str(v) for v in asdict(row).values()))
    console.print(table)
