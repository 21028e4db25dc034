"""The decode slotter's rule, with a fake clock and a fake batch (one module under test)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from worker.batch_engine import StepResult
from worker.decode_slotting import DecodeSlotter

CRITICAL, STANDARD, BATCH = 0.4, 1.0, 5.0  # TBT targets of config/tiers.toml


@dataclass(eq=False)
class Row:
    request_id: str
    target_s: float


class FakeBatch:
    """Rows that never finish; each step takes ``step_s`` of the fake clock and records the
    rows it decoded."""

    step_pending = False  # its steps never stop part-way
    pending_rows = ()

    def __init__(self, clock: list[float], rows: list[Row], step_s: float = 0.02) -> None:
        self.clock, self.rows, self.step_s, self.steps = clock, rows, step_s, 0
        self.stepped: list[tuple[str, ...]] = []

    def decode_step(self, listener, stop=None, rows=None) -> StepResult:
        self.clock[0] += self.step_s
        self.steps += 1
        stepped = tuple(self.rows if rows is None else rows)
        self.stepped.append(tuple(row.request_id for row in stepped))
        return StepResult(stepped, tuple(0 for _ in stepped), torch.empty(0), ())


def slotter_over(rows: list[Row]) -> tuple[DecodeSlotter, FakeBatch, list[float]]:
    clock = [0.0]
    batch = FakeBatch(clock, rows)
    slotter = DecodeSlotter(batch, lambda row: row.target_s, clock=lambda: clock[0])
    for row in rows:
        slotter.joined(row, at=0.0)
    return slotter, batch, clock


def run_prefill(slotter: DecodeSlotter, clock: list[float], target_s: float, blocks: int) -> None:
    """A prefill of ``blocks`` blocks of 20 ms, the slotter at every boundary."""
    slotter.prefill_started(target_s)
    for _ in range(blocks):
        clock[0] += 0.02
        slotter()


def test_a_critical_prefill_takes_no_step_for_lower_tier_rows():
    slotter, batch, clock = slotter_over([Row("s", STANDARD)])
    run_prefill(slotter, clock, CRITICAL, blocks=100)  # 2 s: the row is long overdue
    assert batch.steps == 0


def test_a_critical_prefill_steps_for_critical_rows_within_their_target():
    slotter, batch, clock = slotter_over([Row("c", CRITICAL), Row("s", STANDARD)])
    run_prefill(slotter, clock, CRITICAL, blocks=100)
    assert batch.steps >= 4  # about one a 0.4 s target over 2 s of prefill and steps
    assert clock[0] - slotter._last_token_at["c"] < CRITICAL


def test_a_lower_tier_prefill_steps_for_every_tighter_row():
    slotter, batch, clock = slotter_over([Row("s", STANDARD)])
    run_prefill(slotter, clock, float("inf"), blocks=100)  # a batch-tier prefill, say
    assert batch.steps >= 1
    assert clock[0] - slotter._last_token_at["s"] < STANDARD


def test_a_step_slotted_for_tighter_rows_decodes_them_alone():
    """The batch tier's rows do not ride along in a step slotted into a standard prefill for
    the critical and standard rows: each of them would make the prefill wait longer."""
    slotter, batch, clock = slotter_over(
        [Row("b0", BATCH), Row("c", CRITICAL), Row("b1", BATCH), Row("s", STANDARD)]
    )
    run_prefill(slotter, clock, STANDARD, blocks=100)
    assert batch.steps >= 4
    assert set(batch.stepped) == {("c", "s")}


def test_a_stopped_step_of_looser_rows_is_dropped_for_a_step_of_the_tight_rows(tiny_llama):
    """A critical prefill stops a step of a critical and a batch-tier row; the step slotted
    into that prefill for the critical row decodes it alone (the stopped step is dropped, not
    finished with the batch row), and both rows' tokens are still the model's."""
    from tests.unit.test_batch_engine import Streams, greedy, make_engine, prompt, reference
    from worker.preemption import PreemptionChannel

    model = tiny_llama.model
    engine, channel, streams = make_engine(model, slots=4, batch=4), PreemptionChannel(), Streams()
    targets = {"b": 5.0, "c": CRITICAL}
    prompts = {name: prompt(9 + 4 * i, model.config.vocab_size, seed=40 + i)
               for i, name in enumerate(targets)}  # fmt: skip
    tasks = {name: engine.new_task(greedy(name, ids, 6)) for name, ids in prompts.items()}
    slotter = DecodeSlotter(
        engine, lambda t: targets[t.request_id], streams.record_step, listener=streams
    )
    for task in tasks.values():
        engine.prefill(task, channel, streams)
        engine.join(task)
    assert slotter.step(stop=lambda: True).tasks == ()  # stopped after its first layer
    assert {t.request_id for t in engine.pending_rows} == {"b", "c"}
    result = slotter.step(slotted=True, rows=[tasks["c"]])
    assert [t.request_id for t in result.tasks] == ["c"] and not engine.step_pending
    while engine.rows:
        slotter.step()
    for name, ids in prompts.items():
        tokens, logits = reference(model, ids, 6)
        assert streams.tokens[name] == tokens, name
        torch.testing.assert_close(torch.stack(streams.logits[name]), logits, atol=1e-4, rtol=0)


class StoppingBatch(FakeBatch):
    """Its first step stops after 10 ms of the fake clock; the next call finishes it (20 ms)."""

    def __init__(self, clock: list[float], rows: list[Row]) -> None:
        super().__init__(clock, rows)
        self.step_pending = False

    def decode_step(self, listener, stop=None, rows=None):
        if self.steps == 0 and not self.step_pending:
            self.clock[0] += 0.01
            self.step_pending = True
            return None
        self.step_pending = False
        return super().decode_step(listener, stop, rows)


def test_a_step_stopped_and_finished_reports_its_whole_time_and_each_calls():
    clock = [0.0]
    batch = StoppingBatch(clock, [Row("c", CRITICAL)])
    results = []
    slotter = DecodeSlotter(batch, lambda row: row.target_s, results.append,
                            clock=lambda: clock[0])  # fmt: skip
    slotter.step(stop=lambda: True)
    slotter.step()
    stopped, finished = results
    assert stopped.tasks == () and stopped.seconds == pytest.approx(0.01)
    assert finished.seconds == pytest.approx(0.02)  # this call's: the worker's busy time
    assert finished.step_seconds == pytest.approx(0.03)  # the step's: what a step costs
    assert slotter.step_s == pytest.approx(0.03)
