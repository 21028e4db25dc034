"""``tierflow.recent.RecentMap``: bounded, insertion-ordered, oldest forgotten first."""

from __future__ import annotations

import pytest

from tierflow.recent import RecentMap


def test_keeps_the_last_capacity_keys_with_their_values():
    recent: RecentMap[str, int] = RecentMap(3)
    for i, key in enumerate("abcde"):
        recent[key] = i
    assert list(recent) == ["c", "d", "e"]
    assert (len(recent), recent["d"], recent.get("e")) == (3, 3, 4)
    assert "a" not in recent and recent.get("a") is None and recent.get("a", -1) == -1
    with pytest.raises(KeyError):
        recent["b"]


def test_putting_a_key_again_makes_it_the_newest():
    recent: RecentMap[str, None] = RecentMap(2)
    recent.add("a")
    recent.add("b")
    recent.add("a")  # "b" is now the oldest
    recent.add("c")
    assert list(recent) == ["a", "c"]


def test_capacity_zero_remembers_nothing_and_negative_is_refused():
    recent: RecentMap[str, None] = RecentMap(0)
    recent.add("a")
    assert len(recent) == 0 and "a" not in recent
    with pytest.raises(ValueError):
        RecentMap(-1)
