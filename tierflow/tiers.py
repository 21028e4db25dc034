"""Service tiers: their order, TTFT and TBT SLOs and whether they may be shed under overload.

The tier of a request comes from who sent it (the gateway maps API keys to tier names); this
module only says what a tier means. The table is read from a TOML file whose format is documented
at the top of ``config/tiers.toml``; the scheduler and the gateway share that file.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The repository's default table; TIERFLOW_TIERS_FILE points elsewhere (deployments, tests).
DEFAULT_TIERS_PATH = Path(__file__).resolve().parents[1] / "config" / "tiers.toml"
TIERS_FILE_ENV = "TIERFLOW_TIERS_FILE"

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_KEYS = {"rank", "ttft_slo_s", "tbt_slo_s", "sheddable", "overflow", "borrow_limit"}
# What admission does with a request of a tier whose capacity it would exceed
# (``queue_service.scheduler.capacity``): serve it at the next tier down, or refuse it.
OVERFLOW_RULES = ("downgrade", "reject")


# The metadata headers of the edge contract (docs/design.md, "Contracts between the parts"):
# the client sends its API key; the gateway replaces it with the tier, overwriting whatever
# tier the client sent.
API_KEY_HEADER = "x-api-key"
TIER_HEADER = "x-tierflow-tier"
# The label of the key that sent a request (set by the gateway, never the key): the request log
# records it, so an audit can tell customers apart without holding their keys.
KEY_ID_HEADER = "x-tierflow-key-id"
# That key's share of its tier (``weight`` in config/keys.toml, set by the gateway): the
# scheduler serves the keys of a tier in weighted fair order.
KEY_WEIGHT_HEADER = "x-tierflow-key-weight"
MAX_KEY_WEIGHT = 1000.0  # a share is a ratio between keys: 1000:1 is as uneven as it gets
# On a response: the tier the key asked for, when admission served the request at a lower one
# because the asked tier was at capacity (its overflow rule); x-tierflow-tier names the one
# that served it.
REQUESTED_TIER_HEADER = "x-tierflow-requested-tier"


class UnknownTierError(ValueError):
    """A request named a tier that the table does not define."""


@dataclass(frozen=True)
class TierPolicy:
    name: str
    rank: int  # 0 = most important
    ttft_slo_s: float
    sheddable: bool = False
    # Time between tokens while decoding: the batched engine slots a decode step into a running
    # prefill when waiting longer would miss it. None: no target (decode waits for prefills).
    tbt_slo_s: float | None = None
    # Admission against the tier's capacity: "downgrade", "reject", or None (admit everything).
    overflow: str | None = None
    # A key over its share of the tier is admitted into the tier's spare capacity only while
    # the tier's prefills take less than this share of its workers' time (1.0: all of it). The
    # tier goes first, so what it borrows the lower tiers lose (docs/design.md, "Admission").
    borrow_limit: float = 1.0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"tier name {self.name!r} must be lower-case letters, digits, '_' or '-'"
            )
        # bool is an int subclass; `rank = true` in TOML is a typo, not rank 1.
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"tier {self.name!r}: rank must be an integer >= 0, got {self.rank!r}")
        slo = self.ttft_slo_s
        if isinstance(slo, bool) or not isinstance(slo, int | float) or not math.isfinite(slo):
            raise ValueError(f"tier {self.name!r}: ttft_slo_s must be a number, got {slo!r}")
        if slo <= 0:
            raise ValueError(f"tier {self.name!r}: ttft_slo_s must be > 0, got {slo!r}")
        tbt = self.tbt_slo_s
        if tbt is not None and (
            isinstance(tbt, bool) or not isinstance(tbt, int | float) or not math.isfinite(tbt)
            or tbt <= 0
        ):  # fmt: skip
            raise ValueError(f"tier {self.name!r}: tbt_slo_s must be a number > 0, got {tbt!r}")
        if not isinstance(self.sheddable, bool):
            raise ValueError(
                f"tier {self.name!r}: sheddable must be true or false, got {self.sheddable!r}"
            )
        limit = self.borrow_limit
        if (
            isinstance(limit, bool) or not isinstance(limit, int | float)
            or not 0 <= limit <= 1
        ):  # fmt: skip
            raise ValueError(
                f"tier {self.name!r}: borrow_limit must be a number in [0, 1], got {limit!r}"
            )
        if self.overflow is not None and self.overflow not in OVERFLOW_RULES:
            raise ValueError(
                f"tier {self.name!r}: overflow must be one of {', '.join(OVERFLOW_RULES)}, "
                f"got {self.overflow!r}"
            )


class TierTable:
    """The tiers, ordered by rank (most important first), looked up by name."""

    def __init__(self, tiers: Iterable[TierPolicy]) -> None:
        ordered = sorted(tiers, key=lambda t: t.rank)
        if not ordered:
            raise ValueError("a tier table needs at least one tier")
        by_name: dict[str, TierPolicy] = {}
        ranks: dict[int, str] = {}
        for tier in ordered:
            if tier.name in by_name:
                raise ValueError(f"tier {tier.name!r} is defined twice")
            if tier.rank in ranks:
                raise ValueError(
                    f"tiers {ranks[tier.rank]!r} and {tier.name!r} share rank {tier.rank}; "
                    "ranks must be unique so that tier order is total"
                )
            by_name[tier.name] = tier
            ranks[tier.rank] = tier.name
        self._ordered = tuple(ordered)
        self._by_name = by_name
        self._judged = tuple(
            tier.name
            for above, tier in zip((None, *ordered), ordered, strict=False)
            if tier.overflow is not None or (above is not None and above.overflow == "downgrade")
        )
        last = ordered[-1]
        if last.overflow == "downgrade":
            raise ValueError(
                f"tier {last.name!r} is the lowest tier: it has no tier to downgrade to"
            )

    def below(self, name: str) -> TierPolicy | None:
        """The next tier down from ``name`` (None for the lowest)."""
        index = self._ordered.index(self.get(name))
        return self._ordered[index + 1] if index + 1 < len(self._ordered) else None

    def judged(self) -> tuple[str, ...]:
        """The tiers that admission judges against their capacity: those with an ``overflow``
        rule, and the tier a ``downgrade`` sends to (a downgraded request is served there only
        if it can meet that tier's SLO too)."""
        return self._judged

    def get(self, name: str) -> TierPolicy:
        """The tier called ``name``; UnknownTierError (a ValueError) when there is none."""
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            known = ", ".join(self.names)
            raise UnknownTierError(f"unknown tier {name!r}; known tiers: {known}") from None

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[TierPolicy]:
        return iter(self._ordered)

    def __len__(self) -> int:
        return len(self._ordered)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._ordered)

    def __repr__(self) -> str:
        return f"TierTable({list(self._ordered)!r})"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "<tiers>") -> TierTable:
        """Build the table from parsed TOML (the whole document; only ``tiers`` is read)."""
        section = data.get("tiers")
        if not isinstance(section, Mapping) or not section:
            raise ValueError(f"{source}: no [tiers.<name>] tables")
        tiers = []
        for name, body in section.items():
            if not isinstance(body, Mapping):
                raise ValueError(f"{source}: tiers.{name} must be a table")
            unknown = set(body) - _KEYS
            if unknown:
                raise ValueError(
                    f"{source}: tiers.{name}: unknown key(s) {sorted(unknown)}; "
                    f"allowed: {sorted(_KEYS)}"
                )
            missing = {"rank", "ttft_slo_s"} - set(body)
            if missing:
                raise ValueError(f"{source}: tiers.{name}: missing key(s) {sorted(missing)}")
            try:
                tiers.append(
                    TierPolicy(
                        name=name,
                        rank=body["rank"],
                        ttft_slo_s=body["ttft_slo_s"],
                        sheddable=body.get("sheddable", False),
                        tbt_slo_s=body.get("tbt_slo_s"),
                        overflow=body.get("overflow"),
                        borrow_limit=body.get("borrow_limit", 1.0),
                    )
                )
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
        try:
            return cls(tiers)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def loads_tiers(text: str, *, source: str = "<string>") -> TierTable:
    """Parse a tiers TOML document."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: invalid TOML: {exc}") from None
    return TierTable.from_mapping(data, source=source)


def load_tiers(path: str | os.PathLike[str] | None = None) -> TierTable:
    """Read the tier table from ``path``, else $TIERFLOW_TIERS_FILE, else config/tiers.toml."""
    if path is None:
        path = os.environ.get(TIERS_FILE_ENV) or DEFAULT_TIERS_PATH
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"tiers file not found: {path}") from None
    return loads_tiers(text, source=str(path))
