"""RenewalWatch on its own, with a fake clock: when a consumer renewed after a Kafka outage is
renewed once more. The bridge swapping real consumers is tests/integration/test_kafka_io.py."""

from __future__ import annotations

from queue_service.broker.bridge import RenewalWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_renewed_consumer_with_partitions_is_kept() -> None:
    clock = Clock()
    watch = RenewalWatch(grace_s=12.0, clock=clock)
    watch.outage_over()
    watch.renewed()
    clock.now += 11.9
    assert not watch.renew_again(holds_partitions=False)  # still within its grace
    clock.now += 0.2
    assert not watch.renew_again(holds_partitions=True)
    clock.now += 60.0
    assert not watch.renew_again(holds_partitions=False)  # checked once per renewal


def test_one_holding_nothing_after_its_grace_is_renewed_up_to_the_limit_per_outage() -> None:
    clock = Clock()
    watch = RenewalWatch(grace_s=12.0, max_consumers=3, clock=clock)
    decisions = []
    watch.outage_over()
    watch.renewed()  # the first fresh consumer after the outage
    for _ in range(4):
        clock.now += 12.0
        again = watch.renew_again(holds_partitions=False)
        decisions.append(again)
        if again:
            watch.renewed()
    assert decisions == [True, True, False, False]  # three consumers in all
    watch.outage_over()  # the next outage starts the count again
    watch.renewed()
    clock.now += 12.0
    assert watch.renew_again(holds_partitions=False)


def test_nothing_is_renewed_without_an_outage() -> None:
    clock = Clock()
    watch = RenewalWatch(grace_s=12.0, clock=clock)
    clock.now += 1000.0
    assert not watch.renew_again(holds_partitions=False)
