"""API keys and the tiers they grant: the keys file, and a store that follows its changes.

The file format is documented at the top of ``config/keys.toml``. Only the sha256 of a key is
stored, so the file can be read (backups, config repositories, logs of a diff) without handing
out keys. Nothing in this module logs or raises with key material: error messages name a key by
its label, and a presented key appears in logs only as a fingerprint (8 hex characters of its
hash), which identifies it to whoever holds the file and tells nobody else anything.

    python -m gateway.keys new critical --name acme   # a fresh key + its TOML entry
    python -m gateway.keys hash < key.txt             # the sha256 of a key (stdin or argument)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from tierflow.tiers import MAX_KEY_WEIGHT, TierTable

log = structlog.get_logger("gateway.keys")

MIN_KEY_LENGTH = 16  # what hash_key accepts for a new key; shorter ones are guessable
_HASH = re.compile(r"^[0-9a-f]{64}$")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces: a valid header value
_FIELDS = {"sha256", "tier"}
_OPTIONAL = {"weight"}
_TOP_LEVEL = {"keys", "tiers"}  # [tiers] is tolerated so one file may hold both tables


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def hash_key(key: str) -> str:
    """The sha256 hex digest of ``key``: what the keys file stores in ``sha256``.

    Checks that ``key`` is usable as one (printable ASCII without spaces, so that it travels in
    an HTTP header unchanged; at least MIN_KEY_LENGTH characters) and raises ValueError, without
    repeating the key, when it is not.
    """
    if not isinstance(key, str) or not _KEY_CHARS.match(key):
        raise ValueError("an API key must be printable ASCII without spaces")
    if len(key) < MIN_KEY_LENGTH:
        raise ValueError(f"an API key must be at least {MIN_KEY_LENGTH} characters long")
    return _digest(key)


def fingerprint(key_hash: str) -> str:
    """What logs show of a key: the first 8 hex characters of its hash."""
    return key_hash[:8]


def key_fingerprint(key: str) -> str:
    """The fingerprint of a presented key, known or not (for the log line of a refusal)."""
    return fingerprint(_digest(key))


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return "tf-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ApiKey:
    name: str  # the label of its [keys.<name>] table: who holds it, for logs and revocation
    sha256: str
    tier: str
    weight: float = 1.0  # its share of its tier, against the tier's other keys

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.sha256)


class KeyTable:
    """An immutable set of keys, looked up by the key a client presents."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        by_hash: dict[str, ApiKey] = {}
        for key in keys:
            other = by_hash.get(key.sha256)
            if other is not None:
                raise ValueError(
                    f"keys.{other.name} and keys.{key.name} have the same sha256 (the same key); "
                    "a key grants exactly one tier"
                )
            by_hash[key.sha256] = key
        self._by_hash = by_hash

    def lookup(self, key: str | None) -> ApiKey | None:
        # A dict lookup by hash: its timing depends on the hash, which reveals nothing usable
        # about the stored keys, so no constant-time comparison is needed.
        if not key:
            return None
        return self._by_hash.get(_digest(key))

    def __len__(self) -> int:
        return len(self._by_hash)

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self._by_hash.values())

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], tiers: TierTable, *, source: str = "<keys>"
    ) -> KeyTable:
        """Build the table from a parsed keys document; every tier must be in ``tiers``."""
        unknown = set(data) - _TOP_LEVEL
        if unknown:
            raise ValueError(
                f"{source}: unknown top-level key(s) {sorted(unknown)}; keys go in [keys.<name>]"
            )
        section = data.get("keys")
        if not isinstance(section, Mapping) or not section:
            raise ValueError(f"{source}: no [keys.<name>] tables")
        keys = []
        for name, body in section.items():
            where = f"{source}: keys.{name}"
            if not _LABEL.match(name):
                raise ValueError(f"{where}: a key's name must be letters, digits, '_', '-' or '.'")
            if not isinstance(body, Mapping):
                raise ValueError(f"{where} must be a table with sha256 and tier")
            extra = set(body) - _FIELDS - _OPTIONAL
            if extra:
                raise ValueError(
                    f"{where}: unknown field(s) {sorted(extra)}; allowed: sha256, tier, weight"
                )
            missing = _FIELDS - set(body)
            if missing:
                raise ValueError(f"{where}: missing field(s) {sorted(missing)}")
            digest, tier = body["sha256"], body["tier"]
            # The value is never echoed: a plaintext key pasted here by mistake must not end
            # up in a log.
            if not isinstance(digest, str) or not _HASH.match(digest.lower()):
                raise ValueError(
                    f"{where}: sha256 must be 64 hex characters, the sha256 of the key "
                    "(`python -m gateway.keys hash` prints it); never the key itself"
                )
            if not isinstance(tier, str) or tier not in tiers:
                raise ValueError(
                    f"{where}: tier {tier!r} is not in the tier table "
                    f"(known tiers: {', '.join(tiers.names)})"
                )
            weight = body.get("weight", 1)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not 0 < weight <= MAX_KEY_WEIGHT
            ):
                raise ValueError(
                    f"{where}: weight must be a number in (0, {MAX_KEY_WEIGHT:g}], got {weight!r}"
                )
            keys.append(ApiKey(name=name, sha256=digest.lower(), tier=tier, weight=float(weight)))
        try:
            return cls(keys)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def loads_keys(text: str, tiers: TierTable, *, source: str = "<string>") -> KeyTable:
    """Parse a keys TOML document."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: invalid TOML: {exc}") from None
    return KeyTable.from_mapping(data, tiers, source=source)


def load_keys(path: str | os.PathLike[str], tiers: TierTable) -> KeyTable:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"keys file not found: {path}") from None
    return loads_keys(text, tiers, source=str(path))


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    # The inode too: an editor or `mv` that replaces the file may keep mtime and size.
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeyStore:
    """The keys of a file, reloaded when the file changes and on demand (SIGHUP).

    ``lookup`` looks at the file's mtime at most every ``check_interval_s`` seconds and reloads
    it when it changed. A reload that fails (bad TOML, unknown tier, file gone...) keeps the
    keys in force and logs an error, so a typo never locks every client out; the same broken
    version is not parsed again until the file changes once more.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tiers: TierTable,
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.tiers = tiers
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._signature = _signature(self.path)
        self._table = load_keys(self.path, tiers)  # the first load must succeed: raise
        self._checked_at = clock()

    @property
    def table(self) -> KeyTable:
        return self._table

    def lookup(self, key: str | None) -> ApiKey | None:
        self._maybe_reload()
        return self._table.lookup(key)

    def reload(self) -> bool:
        """Re-read the file now. True when the new keys are in force; False when it failed and
        the previous keys stay."""
        with self._lock:
            signature = _signature(self.path)
            try:
                table = load_keys(self.path, self.tiers)
            except (OSError, ValueError) as exc:
                self._signature = signature  # do not retry this version on every lookup
                log.error(
                    "keys reload failed; keeping the previous keys",
                    path=str(self.path),
                    error=str(exc),
                    keys=len(self._table),
                )
                return False
            self._signature = signature
            self._table = table
        log.info("keys loaded", path=str(self.path), keys=len(table))
        return True

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked_at < self.check_interval_s:
            return
        self._checked_at = now
        if _signature(self.path) != self._signature:
            self.reload()


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.keys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    hash_cmd = sub.add_parser("hash", help="print the sha256 of a key")
    hash_cmd.add_argument("key", nargs="?", help="default: read from stdin (keeps it off `ps`)")
    new_cmd = sub.add_parser("new", help="make a key; print it and its keys-file entry")
    new_cmd.add_argument("tier")
    new_cmd.add_argument("--name", default="", help="label of the entry (who holds the key)")
    args = parser.parse_args(argv)
    if args.command == "hash":
        key = args.key if args.key is not None else sys.stdin.readline().strip()
        try:
            print(hash_key(key))
        except ValueError as exc:
            parser.error(str(exc))
        return 0
    key = new_key()
    name = args.name or f"{args.tier}-{fingerprint(hash_key(key))}"
    print(f"key (give it to the client; it is not stored anywhere): {key}", file=sys.stderr)
    print(f'[keys.{name}]\nsha256 = "{hash_key(key)}"\ntier = "{args.tier}"')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
