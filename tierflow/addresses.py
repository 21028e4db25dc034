"""Service addresses as the command lines take them: ``host:port``, or ``[v6]:port``."""

from __future__ import annotations


def parse_target(target: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {target!r}")
    return host.strip("[]"), int(port)
