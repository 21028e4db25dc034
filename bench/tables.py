"""Printing rich tables so that they stay readable at any width.

rich shrinks a table wider than its console by cutting words to stubs ("poli…"), and a console
that writes to a file or a pipe is 80 columns wide. So a table that does not fit is printed as
several narrower ones: each repeats the leading key columns (policy, tier) and takes as many
of the other columns, in order, as fit. Nothing is cut; a column too wide even alone folds.
"""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table


def print_table(console: Console, table: Table, keys: int = 1) -> None:
    """Print ``table`` whole if it fits ``console``, else split by columns (see above)."""
    for part in fit_table(console, table, keys):
        console.print(part)


def fit_table(console: Console, table: Table, keys: int = 1) -> list[Table]:
    """``table`` itself when it fits the console's width, else the parts described above."""
    if _width(console, table) <= console.width:
        return [table]
    key_columns, rest = table.columns[:keys], table.columns[keys:]
    groups: list[list[Column]] = []
    for column in rest:
        if groups and _width(console, _part(table, key_columns + groups[-1] + [column])) <= (
            console.width
        ):
            groups[-1].append(column)
        else:
            groups.append([column])
    parts = [_part(table, key_columns + group) for group in groups]
    for i, part in enumerate(parts):
        if part.title and i:
            part.title = f"{table.title} (continued)"
    return parts


def _part(table: Table, columns: list[Column]) -> Table:
    part = Table(title=table.title, caption=table.caption, box=table.box)
    for column in columns:
        # fold rather than "…": a column wider than the console alone still shows every letter
        part.columns.append(replace(column, overflow="fold", _index=len(part.columns)))
    part.rows.extend(table.rows)  # a row is its style and section end; cells live in columns
    return part


def _width(console: Console, table: Table) -> int:
    """The table's natural width (measured unbounded: a measurement is clamped to the width
    it is given)."""
    return Measurement.get(console, console.options.update_width(10_000), table).maximum
