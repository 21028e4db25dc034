"""The strict-priority consumer of the tier topics, committing a request only when finished.

* **Strict priority without hoarding.** ``PriorityConsumer`` reads the tier topics
  (``<prefix>priority_<tier>``, most important first) and pauses every tier below the most
  important one that has work waiting, in its buffer or still in Kafka. A batch backlog therefore
  stays in Kafka, not in this process; the buffer of fetched-but-not-handed-out records is
  bounded, and when a more important request arrives into a full buffer the least important
  buffered record is dropped again (its partition is rewound, nothing is lost).
* **Committed when finished.** An offset is committed only when the request at it is finished,
  in any order: per partition the consumer commits the lowest offset not yet finished, and puts
  the finished offsets above it in the commit's metadata (``queue_service.broker.offset_ledger``). A
  consumer that restarts in the same group therefore re-delivers exactly the requests that were
  not finished (at-least-once; the only duplicates are requests whose finish had not reached the
  broker yet). A request id seen twice (a retry that was written twice, a re-delivery after a
  rebalance) is handed out once while the first is live, and not again for a while after it
  finished.

Threads (kafka-python is blocking, and its consumer is not thread-safe): ``poll``, ``waiting``,
``paused_tiers`` and ``close`` belong to ONE thread, the consumer thread, which calls ``poll`` in
a loop (at least every ``max_poll_interval_ms``; with ``max_records=0`` when the scheduler wants
nothing, which keeps the group membership alive) and hands deliveries to the asyncio loop
(``loop.call_soon_threadsafe``). ``finished`` may be called from any thread, typically the
asyncio loop; it only queues the mark, which the consumer thread applies and commits on its next
turn (within one poll slice, ``POLL_SLICE_S``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog
from google.protobuf.message import DecodeError
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from queue_service.broker.io import QueueUnavailableError, tier_names
from queue_service.broker.offset_ledger import Ledger, parse_metadata
from tierflow.kafka_settings import KafkaSettings
from tierflow.recent import RecentMap
from tierflow.tiers import TierPolicy
from tierflow.v1 import queue_pb2

log = structlog.get_logger("queue_service.broker.priority_consumer")

# How long the consumer thread waits inside Kafka before it looks again at finished requests to
# commit and at the priorities to apply: a commit is at most this late.
POLL_SLICE_S = 0.05


@dataclass(frozen=True)
class DeliveredRequest:
    """A request read from its tier topic, and where it was read (to commit it when finished).

    Equal and hashed by its place in Kafka, not by the message."""

    tier: str
    request: queue_pb2.QueuedRequest = field(compare=False, repr=False)
    topic: str
    partition: int
    offset: int

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def topic_partition(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


@dataclass
class _Live:
    """A request handed out (or buffered to be), and the duplicate records that end with it."""

    delivered: DeliveredRequest
    aliases: set[tuple[TopicPartition, int]] = field(default_factory=set)


class _Listener(ConsumerRebalanceListener):
    """Runs on kafka-python's IO thread: it only records the change for the consumer thread."""

    def __init__(self, events: deque[tuple[str, frozenset[TopicPartition]]]) -> None:
        self._events = events

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self._events.append(("revoked", frozenset(revoked)))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._events.append(("assigned", frozenset(assigned)))

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        self._events.append(("revoked", frozenset(lost)))


class PriorityConsumer:
    """Consumes the tier topics in strict priority; commits a request when it is finished.

    ``tiers``: tier names most important first, or a TierTable. See the module docstring for
    which thread may call what.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        tiers: Iterable[str | TierPolicy],
        *,
        group_id: str | None = None,
        max_buffered: int = 64,
        remember_finished: int = 10_000,
    ) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")
        self.settings = settings
        self.tiers = tier_names(tiers)
        if not self.tiers:
            raise ValueError("a priority consumer needs at least one tier")
        self.max_buffered = max_buffered
        self._tier_of_topic = {settings.tier_topic(t): t for t in self.tiers}
        self._rank = {t: i for i, t in enumerate(self.tiers)}
        self._buffer: list[deque[DeliveredRequest]] = [deque() for _ in self.tiers]
        self._ledgers: dict[TopicPartition, Ledger] = {}
        self._live: dict[str, _Live] = {}
        self._finished_ids: RecentMap[str, None] = RecentMap(max(0, remember_finished))
        # End offsets learnt by asking (ListOffsets) when a partition's own fetches are stale.
        self._known_end: dict[TopicPartition, int] = {}
        self._events: deque[tuple[str, frozenset[TopicPartition]]] = deque()
        self._finished_inbox: deque[DeliveredRequest] = deque()  # filled from any thread
        self._dirty: set[TopicPartition] = set()
        self._closed = False
        self.duplicates = 0  # records skipped because their request id was live or finished
        self.undecodable = 0  # records that were not a QueuedRequest (skipped and committed)
        try:
            self._consumer = KafkaConsumer(**settings.consumer_config(group_id))
            self._consumer.subscribe(
                topics=list(self._tier_of_topic), listener=_Listener(self._events)
            )
            # Learn the topics' partitions before the first poll joins the group. Otherwise
            # kafka-python 3.0.12 joins with no partition metadata, assigns nothing, and rejoins
            # when the metadata arrives; a poll that times out during that second join loses its
            # assignment for good (the rejoin is not remembered once the leader has assigned).
            self._consumer.topics()
        except KafkaError as exc:
            raise QueueUnavailableError(f"Kafka at {settings.bootstrap}: {exc!r}") from exc

    # -- the consumer thread -------------------------------------------------------------

    def poll(self, timeout: float = 0.0, max_records: int | None = None) -> list[DeliveredRequest]:
        """Up to ``max_records`` requests (default: the settings' max_poll_records), all of the
        most important tier that has work, in their order within it. Returns as soon as there
        is something to hand out, else after ``timeout`` seconds. ``max_records=0`` hands out
        nothing but keeps the consumer alive: it fetches into the bounded buffer and commits."""
        if self._closed:
            raise RuntimeError("the consumer is closed")
        limit = self.settings.max_poll_records if max_records is None else max_records
        deadline = time.monotonic() + timeout
        wait_s = 0.0
        while True:
            self._handle_events()
            self._commit(self._apply_finished())
            self._apply_priorities()
            room = max(1, self.max_buffered - self.buffered)  # an overflow is evicted below
            self._unpark_resumed_records()
            records = self._consumer.poll(timeout_ms=int(wait_s * 1000), max_records=room)
            self._handle_events()  # a rebalance happens inside poll
            self._ingest(records)
            self._evict_overflow()
            delivered = self._take(limit)
            remaining = deadline - time.monotonic()
            if delivered or remaining <= 0:
                # Leave the pauses right for what is now known (and for who looks at them).
                self._apply_priorities()
                return delivered
            wait_s = max(0.001, min(remaining, POLL_SLICE_S))

    def waiting(self) -> dict[str, int]:
        """Requests of each tier known to wait: buffered here, plus not yet read from this
        consumer's partitions as of their last fetch."""
        counts = {t: len(self._buffer[r]) for t, r in self._rank.items()}
        for tp in self._consumer.assignment():
            lag = self._lag(tp)
            if lag:
                counts[self._tier_of_topic[tp.topic]] += lag
        return counts

    def owned_tiers(self) -> frozenset[str]:
        """Tiers with at least one partition assigned to this consumer: what it schedules."""
        topics = {tp.topic for tp in self._consumer.assignment()}
        return frozenset(t for topic, t in self._tier_of_topic.items() if topic in topics)

    def paused_tiers(self) -> frozenset[str]:
        """Tiers whose partitions are all paused (some more important tier has work)."""
        assigned = self._consumer.assignment()
        paused = self._consumer.paused()
        return frozenset(
            t
            for topic, t in self._tier_of_topic.items()
            if (tps := {tp for tp in assigned if tp.topic == topic}) and tps <= paused
        )

    @property
    def buffered(self) -> int:
        """Records fetched but not handed out yet (at most ``max_buffered`` between polls)."""
        return sum(len(b) for b in self._buffer)

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is finished (synchronously), leave the group, close."""
        if self._closed:
            return
        self._closed = True
        try:
            self._handle_events()
            self._apply_finished()
            # Every partition, not only the changed ones: an asynchronous commit may have failed.
            self._commit(set(self._ledgers), sync=True, timeout=timeout)
        except KafkaError as exc:
            # Nothing is lost: what was not committed is delivered again after a restart.
            log.warning("final offset commit failed", error=repr(exc))
        finally:
            self._consumer.close(autocommit=False, timeout_ms=int(timeout * 1000))

    def __enter__(self) -> PriorityConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- any thread ------------------------------------------------------------------------

    def finished(self, delivered: DeliveredRequest) -> None:
        """``delivered`` is done with (completed, failed, cancelled or rejected): its offset may
        be committed. Any thread; applied by the consumer thread on its next turn."""
        self._finished_inbox.append(delivered)

    # -- internals (consumer thread) -------------------------------------------------------

    def _handle_events(self) -> None:
        while self._events:
            kind, partitions = self._events.popleft()
            if partitions:  # which partitions this instance reads: the first thing to check
                names = sorted(f"{tp.topic}:{tp.partition}" for tp in partitions)
                log.info(f"kafka partitions {kind}", partitions=names)
            if kind == "assigned":
                # Our knowledge of these partitions' ends predates the assignment.
                for tp in partitions:
                    self._known_end.pop(tp, None)
                continue
            for tp in partitions:
                # Someone else reads these from now on: drop what is buffered (never handed out),
                # keep handed-out requests live (they run to the end; their finish is then not
                # ours to commit, and the new owner may run them again: at-least-once).
                self._ledgers.pop(tp, None)
                self._known_end.pop(tp, None)
                self._dirty.discard(tp)
                for queue in self._buffer:
                    kept = [d for d in queue if d.topic_partition != tp]
                    for d in queue:
                        if d.topic_partition == tp:
                            self._unbuffer(d)
                    queue.clear()
                    queue.extend(kept)

    def _apply_finished(self) -> set[TopicPartition]:
        changed: set[TopicPartition] = set()
        while self._finished_inbox:
            delivered = self._finished_inbox.popleft()
            places = {(delivered.topic_partition, delivered.offset)}
            live = self._live.get(delivered.request_id)
            if live is not None and live.delivered == delivered:
                del self._live[delivered.request_id]
                places |= live.aliases
            self._finished_ids.add(delivered.request_id)
            for tp, offset in places:
                ledger = self._ledgers.get(tp)
                if ledger is not None and ledger.mark_done(offset):
                    changed.add(tp)
        return changed | self._take_dirty()

    def _take_dirty(self) -> set[TopicPartition]:
        dirty, self._dirty = self._dirty, set()
        return dirty

    def _commit(
        self, partitions: set[TopicPartition], *, sync: bool = False, timeout: float = 10.0
    ) -> None:
        offsets = {}
        for tp in partitions:
            ledger = self._ledgers.get(tp)
            point = ledger.commit_point() if ledger is not None else None
            if point is not None and (sync or point != ledger.last_commit):
                offsets[tp] = OffsetAndMetadata(point[0], point[1], -1)
                ledger.last_commit = point
        if not offsets:
            return
        if sync:
            self._consumer.commit(offsets, timeout_ms=int(timeout * 1000))
        else:
            self._consumer.commit_async(offsets, callback=_log_commit_failure)

    def _unpark_resumed_records(self) -> None:
        """Work around kafka-python 3.0.12: records already fetched for a partition that gets
        paused are parked, and brought back on resume only while the fetcher's in-line slot is
        None; but a fully read slot stays a drained (falsy) object, so a resumed partition would
        never be fetched again. A drained slot and None mean the same to the fetcher otherwise.
        (Private state, hence the getattr: a release that renames it makes this a no-op.)"""
        fetcher = getattr(self._consumer, "_fetcher", None)
        slot = getattr(fetcher, "_next_partition_records", None)
        if slot is not None and not slot:
            fetcher._next_partition_records = None

    def _lag(self, tp: TopicPartition) -> int | None:
        """Records in Kafka not read yet from ``tp``; None when not known yet."""
        try:
            position = self._consumer.position(tp, timeout_ms=0)
        except KafkaError:
            return None
        highwater = self._consumer.highwater(tp)  # from fetch responses; None before the first
        end = max(-1 if highwater is None else highwater, self._known_end.get(tp, -1))
        if position is None or end < 0:
            return None
        return max(0, end - position)

    def _ranks_with_work_in_kafka(self, assigned: set[TopicPartition]) -> set[int]:
        ranks = set()
        for tp in assigned:
            lag = self._lag(tp)
            if lag is None or lag > 0:  # unknown counts as work: better wait than overtake
                ranks.add(self._rank[self._tier_of_topic[tp.topic]])
        return ranks

    def _top_rank(self, assigned: set[TopicPartition]) -> int | None:
        """The most important tier with work waiting, here or in Kafka."""
        ranks = self._ranks_with_work_in_kafka(assigned)
        ranks.update(r for r, queue in enumerate(self._buffer) if queue)
        return min(ranks, default=None)

    def _apply_priorities(self) -> None:
        """Pause every tier below the most important one with work; and, while the buffer is
        full, every tier that is no more important than something buffered."""
        assigned = self._consumer.assignment()
        if not assigned:
            return
        paused = self._consumer.paused()
        fetch_up_to = self._fetch_limit(assigned)
        resuming = {tp for tp in assigned & paused if self._rank_of(tp) <= fetch_up_to}
        if resuming:
            # These were paused, so what we know of their ends is stale: ask, then decide again
            # (a tier about to be resumed may itself have work that outranks the rest).
            with contextlib.suppress(KafkaError):
                ends = self._consumer.end_offsets(list(resuming), timeout_ms=5_000)
                self._known_end.update({tp: end for tp, end in ends.items() if end is not None})
            fetch_up_to = self._fetch_limit(assigned)
        want_paused = {tp for tp in assigned if self._rank_of(tp) > fetch_up_to}
        if want_paused - paused:
            self._consumer.pause(*(want_paused - paused))
        if (assigned & paused) - want_paused:
            self._consumer.resume(*((assigned & paused) - want_paused))

    def _fetch_limit(self, assigned: set[TopicPartition]) -> int:
        top = self._top_rank(assigned)
        limit = len(self.tiers) - 1 if top is None else top
        if self.buffered >= self.max_buffered:
            least = max(r for r, queue in enumerate(self._buffer) if queue)
            limit = min(limit, least - 1)
        return limit

    def _rank_of(self, tp: TopicPartition) -> int:
        return self._rank[self._tier_of_topic[tp.topic]]

    def _ledger(self, tp: TopicPartition) -> Ledger:
        ledger = self._ledgers.get(tp)
        if ledger is None:
            # First read since (re)assignment: learn which offsets above the committed one were
            # finished before, so that they are not run again.
            committed = None
            prefinished: set[int] = set()
            try:
                meta = self._consumer.committed(tp, metadata=True, timeout_ms=10_000)
            except KafkaError as exc:
                log.warning("committed offset unknown", partition=str(tp), error=repr(exc))
                meta = None
            if meta is not None and meta.offset is not None and meta.offset >= 0:
                committed = meta.offset
                prefinished = parse_metadata(committed, meta.metadata or "")
            ledger = self._ledgers[tp] = Ledger(committed, prefinished)
        return ledger

    def _ingest(self, records: dict) -> None:
        for tp, batch in records.items():
            tier = self._tier_of_topic.get(tp.topic)
            if tier is None:
                continue
            ledger = self._ledger(tp)
            for rec in batch:
                self._ingest_one(tier, tp, ledger, rec)

    def _ingest_one(self, tier: str, tp: TopicPartition, ledger: Ledger, rec) -> None:
        if rec.offset in ledger.prefinished:
            if ledger.add(rec.offset, done=True):
                self._dirty.add(tp)
            return
        try:
            request = queue_pb2.QueuedRequest.FromString(rec.value or b"")
        except DecodeError:
            request = None
        if request is None or not request.request_id:
            self.undecodable += 1
            log.error(
                "skipping a record that is not a QueuedRequest",
                partition=str(tp),
                offset=rec.offset,
            )
            if ledger.add(rec.offset, done=True):
                self._dirty.add(tp)
            return
        request_id = request.request_id
        live = self._live.get(request_id)
        if live is not None or request_id in self._finished_ids:
            # The same request again: it ends when the first one ends (or already has).
            if not ledger.add(rec.offset, done=live is None):
                return
            self.duplicates += 1
            log.info("duplicate request id skipped", request_id=request_id, tier=tier)
            if live is None:
                self._dirty.add(tp)
            else:
                live.aliases.add((tp, rec.offset))
            return
        if not ledger.add(rec.offset, done=False):
            return
        delivered = DeliveredRequest(tier, request, tp.topic, tp.partition, rec.offset)
        self._live[request_id] = _Live(delivered)
        self._buffer[self._rank[tier]].append(delivered)

    def _evict_overflow(self) -> None:
        """Over the bound: drop the newest record of the least important tier buffered and
        rewind its partition to it, so that it is read again later (it stays in Kafka)."""
        while self.buffered > self.max_buffered:
            queue = next(q for q in reversed(self._buffer) if q)
            victim = queue.pop()
            tp = victim.topic_partition
            # Everything read after it from the same partition is read again, too.
            for q in self._buffer:
                rewound = [d for d in q if d.topic_partition == tp and d.offset > victim.offset]
                for d in rewound:
                    q.remove(d)
                    self._unbuffer(d, rewound_from=(tp, victim.offset))
            self._unbuffer(victim, rewound_from=(tp, victim.offset))
            ledger = self._ledgers.get(tp)
            if ledger is not None:
                ledger.forget_from(victim.offset)
            self._consumer.seek(tp, victim.offset)

    def _unbuffer(
        self, delivered: DeliveredRequest, rewound_from: tuple[TopicPartition, int] | None = None
    ) -> None:
        """A buffered record leaves this consumer unprocessed. Its duplicates in other places
        can be committed: the record itself is still in Kafka, uncommitted."""
        live = self._live.get(delivered.request_id)
        if live is None or live.delivered != delivered:
            return
        del self._live[delivered.request_id]
        for tp, offset in live.aliases:
            if rewound_from is not None and tp == rewound_from[0] and offset >= rewound_from[1]:
                continue  # read again after the rewind anyway
            ledger = self._ledgers.get(tp)
            if ledger is not None and ledger.mark_done(offset):
                self._dirty.add(tp)

    def _take(self, limit: int) -> list[DeliveredRequest]:
        """Hand out buffered requests of the most important tier with work, and of that tier
        only; nothing while its work is still in Kafka (it is fetched first). One tier per call
        because what is known of a paused (less important) tier is stale until the next turn
        has resumed it and asked Kafka for its end."""
        if limit <= 0:
            return []
        top = self._top_rank(self._consumer.assignment())
        if top is None:
            return []
        queue = self._buffer[top]
        return [queue.popleft() for _ in range(min(limit, len(queue)))]


def _log_commit_failure(offsets: dict, response: object) -> None:
    if isinstance(response, Exception):
        # The next commit (they are cumulative) or a re-delivery after a restart covers it.
        log.warning("offset commit failed", error=repr(response), partitions=len(offsets))


# ------------------------------------------------------------------------------------ replies
