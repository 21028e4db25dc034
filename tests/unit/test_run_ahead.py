"""RunAheadLimiter bounds outstanding GPU layers; checked with recording events (no GPU here)."""

from worker.run_ahead import RunAheadLimiter


class RecordingEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record(self) -> None:
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


def make_limiter(max_layers: int):
    log: list[str] = []
    names = iter("abcdefgh")
    return RunAheadLimiter(max_layers, lambda: RecordingEvent(log, next(names))), log


def test_waits_for_the_oldest_layer_once_more_than_the_bound_is_outstanding():
    limiter, log = make_limiter(2)
    for _ in range(4):
        limiter.layer_done()
    # Layers 1 and 2 queue freely; the 3rd waits for the 1st, the 4th for the 2nd.
    assert log == ["record a", "record b", "record c", "wait a", "record a", "wait b"]
    limiter.drain()
    assert log[-2:] == ["wait c", "wait a"]


def test_events_are_reused_not_allocated_per_layer():
    limiter, log = make_limiter(1)
    for _ in range(10):
        limiter.layer_done()
    assert {entry.split()[1] for entry in log} == {"a", "b"}


def test_cpu_limiter_is_a_no_op():
    limiter = RunAheadLimiter.for_device("cpu", 2)
    assert not limiter.enabled
    limiter.layer_done()
    limiter.drain()
