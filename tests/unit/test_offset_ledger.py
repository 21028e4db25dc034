"""The offset ledger of the priority consumer, without a broker: what is committed when
requests finish out of order, and what a restarted consumer skips."""

from __future__ import annotations

from queue_service.broker.offset_ledger import METADATA_MAX_CHARS, Ledger, parse_metadata


def _read(ledger: Ledger, offsets) -> None:
    for offset in offsets:
        assert ledger.add(offset, done=False)


def test_nothing_read_and_nothing_committed_means_nothing_to_commit():
    assert Ledger(None, set()).commit_point() is None
    assert Ledger(7, set()).commit_point() == (7, "")  # the committed offset stands


def test_commits_the_lowest_unfinished_offset_and_lists_the_finished_ones_above_it():
    ledger = Ledger(5, set())
    _read(ledger, [5, 6, 7, 8])
    assert ledger.commit_point() == (5, "")
    assert ledger.mark_done(6) and ledger.mark_done(8)
    assert ledger.commit_point() == (5, "tf1:1,3")
    assert ledger.mark_done(5)
    assert ledger.commit_point() == (7, "tf1:1")
    assert ledger.mark_done(7)
    assert ledger.commit_point() == (9, "")


def test_marks_only_tracked_unfinished_offsets():
    ledger = Ledger(0, set())
    _read(ledger, [0, 1])
    assert ledger.mark_done(1)
    assert not ledger.mark_done(1)  # already finished
    assert not ledger.mark_done(42)  # never read


def test_a_record_read_again_is_not_tracked_twice_until_the_partition_is_rewound():
    ledger = Ledger(0, set())
    _read(ledger, [0, 1, 2, 3])
    assert not ledger.add(2, done=False)  # fetched again: already tracked
    ledger.forget_from(2)  # the consumer rewound to 2: 2 and 3 will be read again
    assert ledger.end == 2 and list(ledger.offsets) == [0, 1]
    assert ledger.add(2, done=False)
    ledger.mark_done(0)
    ledger.mark_done(1)
    assert ledger.commit_point() == (2, "")


def test_a_restarted_consumer_skips_exactly_what_was_finished_before():
    before = Ledger(100, set())
    _read(before, range(100, 110))
    for offset in (102, 105, 109):
        before.mark_done(offset)
    committed, metadata = before.commit_point()
    assert committed == 100
    prefinished = parse_metadata(committed, metadata)
    assert prefinished == {102, 105, 109}
    after = Ledger(committed, prefinished)
    for offset in range(100, 110):
        after.add(offset, done=offset in after.prefinished)
    assert after.commit_point() == (100, "tf1:2,5,9")
    after.mark_done(100)
    after.mark_done(101)
    # Pruned below the new commit point; the rest still listed.
    assert after.commit_point() == (103, "tf1:2,6")
    assert after.prefinished == {105, 109}


def test_metadata_that_is_not_ours_or_unreadable_is_ignored():
    assert parse_metadata(10, "") == set()
    assert parse_metadata(10, "someone else's") == set()
    assert parse_metadata(10, "tf1:1,x") == set()


def test_metadata_is_cut_to_fit_the_broker_limit_keeping_the_nearest_offsets():
    ledger = Ledger(0, set())
    _read(ledger, range(5000))
    for offset in range(1, 5000, 2):
        ledger.mark_done(offset)
    committed, metadata = ledger.commit_point()
    assert committed == 0 and len(metadata) <= METADATA_MAX_CHARS
    listed = parse_metadata(committed, metadata)
    # Left out are the farthest ones, which are re-delivered after a restart, never lost.
    assert listed == set(range(1, max(listed) + 1, 2))
