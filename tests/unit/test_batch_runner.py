"""BatchRunner: the batched engine on its thread (its own, or the caller's), driven from
another thread."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from tests.unit.test_batch_engine import prompt, reference
from worker.batch_engine import BatchEngine
from worker.batch_runner import BatchRunner
from worker.config import BatchConfig, EngineConfig
from worker.events import (
    Cancelled,
    DecodeRejoined,
    DecodeStepDone,
    Failed,
    Finished,
    FirstToken,
    Preempted,
)
from worker.request import GenerationRequest


class Stream:
    """Collects events; can pause a request from the engine thread after its n-th token."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.pause_after: tuple[str, int, bool] | None = None
        self.runner: BatchRunner | None = None
        self.counts: dict[str, int] = {}

    def __call__(self, event) -> None:
        self.events.put(event)
        for rid, _, _ in tokens_of(event):
            n = self.counts[rid] = self.counts.get(rid, 0) + 1
            if self.pause_after and self.pause_after[:2] == (rid, n):
                self.runner.preempt(rid, drop_state=self.pause_after[2])

    def until(self, kind, request_id: str | None = None):
        seen = []
        while True:
            event = self.events.get(timeout=60)
            seen.append(event)
            if isinstance(event, kind) and request_id in (None, event.request_id):
                return event, seen


def start(model, stream: Stream, *, slots=6, batch=4, chunk=16) -> BatchRunner:
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=chunk, check="layer"),
        BatchConfig(max_batch_size=batch, pool_slots=slots, slot_tokens=160),
    )
    stream.runner = BatchRunner(engine, stream).start()
    return stream.runner


def greedy(name, ids, n):
    return GenerationRequest(name, ids, max_new_tokens=n, stop_at_eos=False)


def tokens_of(event) -> list[tuple[str, int, int]]:
    """(request id, token, index) of every token an event carries."""
    if isinstance(event, FirstToken):
        return [(event.request_id, event.token_id, 0)]
    if isinstance(event, DecodeStepDone):
        return list(zip(event.request_ids, event.tokens, event.indexes, strict=True))
    return []


def tokens_made(step: DecodeStepDone) -> set[tuple[str, int]]:
    """(request id, index) of every token a step made."""
    return set(zip(step.request_ids, step.indexes, strict=True))


def collect_tokens(events) -> dict[str, list[int]]:
    """Per request, its tokens in the order they were emitted; each index must come once."""
    tokens: dict[str, list[int]] = {}
    for e in events:
        for rid, token, index in tokens_of(e):
            assert index == len(tokens.setdefault(rid, [])), (rid, index)
            tokens[rid].append(token)
    return tokens


def drain(stream: Stream, names) -> list:
    events, left = [], set(names)
    while left:
        event = stream.events.get(timeout=60)
        events.append(event)
        if isinstance(event, Finished | Failed):
            left.discard(event.request_id)
    return events


def test_more_requests_than_rows_all_match_generate(tiny_llama):
    model = tiny_llama.model
    stream = Stream()
    runner = start(model, stream, batch=3)
    prompts = {f"r{i}": prompt(10 + 13 * i, 500, seed=i) for i in range(5)}
    try:
        for i, (name, ids) in enumerate(prompts.items()):
            runner.assign(greedy(name, ids, 8 + i), tbt_slo_s=0.05)
        events = drain(stream, prompts)
    finally:
        runner.stop()
    tokens = collect_tokens(events)
    finished = {e.request_id: e for e in events if isinstance(e, Finished)}
    for i, (name, ids) in enumerate(prompts.items()):
        expected = reference(model, ids, 8 + i)[0]
        assert tokens[name] == expected == list(finished[name].output_ids), name
    assert runner.engine.pool.used_slots == 0 and runner.suspended_bytes == 0


def test_run_serves_on_the_calling_thread_until_stopped_from_another(tiny_llama):
    # The worker process runs its engine on the main thread (BatchRunner.run says why).
    model = tiny_llama.model
    stream = Stream()
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=16, check="layer"),
        BatchConfig(max_batch_size=2, pool_slots=2, slot_tokens=64),
    )
    runner = stream.runner = BatchRunner(engine, stream)
    emitted_on: set[threading.Thread] = set()
    emit = runner.emit
    runner.emit = lambda event: (emitted_on.add(threading.current_thread()), emit(event))
    ids = prompt(20, 500, seed=1)
    ended: list[bool] = []

    def client() -> None:
        runner.assign(greedy("r", ids, 4))
        stream.until(Finished, "r")
        runner.stop()  # returns only once the loop on the other thread has ended
        ended.append(not runner.alive)

    other = threading.Thread(target=client)
    other.start()
    runner.run()
    other.join(60)
    assert (
        emitted_on == {threading.current_thread()}
        and runner.engine_thread is threading.current_thread()
    )
    assert ended == [True]


def test_a_runner_stopped_before_its_loop_starts_ends_it_at_once(tiny_llama):
    runner = BatchRunner(
        BatchEngine(
            tiny_llama.model,
            EngineConfig(),
            BatchConfig(max_batch_size=1, pool_slots=1, slot_tokens=64),
        ),
        lambda event: None,
    )
    runner.stop()  # nothing to wait for yet
    runner.run()  # reads the stop and returns
    assert not runner.alive


@pytest.mark.parametrize("drop_state", [False, True])
def test_paused_decode_resumes_and_streams_each_token_once(tiny_qwen2, drop_state):
    model = tiny_qwen2.model
    stream = Stream()
    runner = start(model, stream)
    ids = {"p": prompt(30, 500, seed=1), "q": prompt(21, 500, seed=2)}
    stream.pause_after = ("p", 4, drop_state)
    try:
        runner.assign(greedy("p", ids["p"], 12))
        runner.assign(greedy("q", ids["q"], 12))
        paused, before = stream.until(Preempted, "p")
        assert paused.state_dropped is drop_state
        if drop_state:
            runner.assign(greedy("p", ids["p"], 12))  # the scheduler's Assign: recompute
        else:
            runner.resume("p")
        events = before + drain(stream, ["p", "q"])
    finally:
        runner.stop()
    tokens = collect_tokens(events)
    for name, p in ids.items():
        assert tokens[name] == reference(model, p, 12)[0], name
    rejoined = [e for e in events if isinstance(e, DecodeRejoined)]
    # A recompute says so (the scheduler learns the request decodes again), sending no token.
    assert [(e.request_id, e.recomputed_tokens) for e in rejoined] == (
        [("p", 30 + 4 - 1)] if drop_state else []
    )
    assert runner.engine.pool.used_slots == 0


class PreemptInside:
    """From an attention module's pre-hook (the engine thread), preempts ``request_id`` once
    the layers' attention has been called ``after`` times (a hooked prefill runs a layer as its
    halves, not through the layer module)."""

    def __init__(self, model, runner: BatchRunner, request_id: str, after: int) -> None:
        self.runner, self.request_id, self.after, self.calls = runner, request_id, after, 0
        attention = [layer.self_attn for layer in model.model.layers]
        self.handles = [m.register_forward_pre_hook(self._hook) for m in attention]

    def _hook(self, module, args) -> None:
        self.calls += 1
        if self.calls == self.after:
            self.runner.preempt(self.request_id)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def test_a_packed_prefill_is_preempted_and_resumed_as_one_and_stays_exact(tiny_llama):
    model = tiny_llama.model
    stream = Stream()
    runner = start(model, stream, slots=6, batch=4)
    ids = {f"k{i}": prompt(9 + 7 * i, 500, seed=20 + i) for i in range(4)}
    requests = [greedy(name, p, 6) for name, p in ids.items()]
    # A Preempt naming one member (not the first) in layer 2 stops the whole pack.
    trigger = PreemptInside(model, runner, "k2", after=2)
    try:
        runner.assign_packed(requests, [0.5] * 4)
        for name in ids:
            acked, _ = stream.until(Preempted, name)
            assert not acked.state_dropped and acked.resume_point.layer == 2
        trigger.remove()
        assert runner.suspended_bytes > 0
        runner.cancel("k0")  # one member goes while the pack is suspended
        stream.until(Cancelled, "k0")
        runner.resume("k3")  # a Resume of any member resumes the pack
        events = drain(stream, ["k1", "k2", "k3"])
    finally:
        trigger.remove()
        runner.stop()
    firsts = {e.request_id: e for e in events if isinstance(e, FirstToken)}
    assert sorted(firsts) == ["k1", "k2", "k3"]
    assert all(
        f.pack_size == 4 and f.pack_tokens == sum(map(len, ids.values())) for f in firsts.values()
    )
    tokens = collect_tokens(events)
    for name in ("k1", "k2", "k3"):
        assert tokens[name] == reference(model, ids[name], 6)[0], name
    assert runner.engine.pool.used_slots == 0 and runner.suspended_bytes == 0


def test_a_preempt_that_misses_the_last_boundary_pauses_the_decode_and_is_acknowledged(
    tiny_llama,
):
    """With checks at chunk ends only (the chunked baseline), a Preempt inside a prompt's only
    chunk finds its first token out: the request is paused (and acknowledged), not lost."""
    model = tiny_llama.model
    stream = Stream()
    engine = BatchEngine(model, EngineConfig(chunk_size=64, check="chunk"), BatchConfig(4, 4, 160))
    runner = stream.runner = BatchRunner(engine, stream).start()
    ids = prompt(30, 500, seed=9)
    trigger = PreemptInside(model, runner, "m", after=2)
    try:
        runner.assign(greedy("m", ids, 8))
        acked, before = stream.until(Preempted, "m")
        trigger.remove()
        assert not acked.state_dropped and any(isinstance(e, FirstToken) for e in before)
        runner.resume("m")
        events = before + drain(stream, ["m"])
    finally:
        trigger.remove()
        runner.stop()
    assert collect_tokens(events)["m"] == reference(model, ids, 8)[0]


def test_a_late_preempt_of_one_pack_member_pauses_that_member_alone(tiny_llama):
    """A Preempt that misses a pack's last boundary pauses only the member it named. The
    scheduler may already count another member as decoding (its first token came first); were
    that one paused too, its acknowledgement would be ignored and the request never finish."""
    model = tiny_llama.model
    stream = Stream()
    engine = BatchEngine(model, EngineConfig(chunk_size=64, check="chunk"), BatchConfig(4, 4, 160))
    runner = stream.runner = BatchRunner(engine, stream).start()
    ids = {"k0": prompt(20, 500, seed=31), "k1": prompt(27, 500, seed=32)}
    trigger = PreemptInside(model, runner, "k1", after=2)
    try:
        runner.assign_packed([greedy(name, p, 6) for name, p in ids.items()], [0.5, 0.5])
        _, before = stream.until(Preempted, "k1")
        trigger.remove()
        _, during = stream.until(Finished, "k0")  # k0 decodes on to its end
        runner.resume("k1")
        events = before + during + drain(stream, ["k1"])
    finally:
        trigger.remove()
        runner.stop()
    assert not any(isinstance(e, Preempted) and e.request_id == "k0" for e in events)
    tokens = collect_tokens(events)
    for name in ids:
        assert tokens[name] == reference(model, ids[name], 6)[0], name


def test_a_resume_of_a_request_that_decodes_already_is_ignored(tiny_llama):
    """A Resume for a row the worker never paused (the scheduler's view was behind) must not
    add the row twice: that raised on the engine thread, and the worker served nothing more."""
    model = tiny_llama.model
    stream = Stream()
    runner = start(model, stream, slots=2, batch=2)
    ids = prompt(12, 500, seed=41)
    try:
        runner.assign(greedy("r", ids, 8))
        _, before = stream.until(FirstToken, "r")
        runner.resume("r")
        events = before + drain(stream, ["r"])
        runner.assign(greedy("after", prompt(12, 500, seed=42), 2))
        stream.until(Finished, "after")
    finally:
        runner.stop()
    assert collect_tokens(events)["r"] == reference(model, ids, 8)[0]


def test_bad_requests_fail_clearly_and_the_runner_keeps_serving(tiny_llama):
    model = tiny_llama.model
    stream = Stream()
    runner = start(model, stream, slots=2, batch=2)
    try:
        runner.assign(greedy("big", prompt(150, 500, seed=3), 20))
        failed, _ = stream.until(Failed, "big")
        assert failed.invalid_request and "larger than a KV slot" in failed.error
        for name in ("a", "b"):
            runner.assign(greedy(name, prompt(12, 500, seed=ord(name)), 60))
        runner.assign(greedy("c", prompt(12, 500, seed=5), 3))  # both slots are taken
        failed, _ = stream.until(Failed, "c")
        assert not failed.invalid_request and "KV slots are in use" in failed.error
        drain(stream, ["a", "b"])
        runner.assign(greedy("e", prompt(12, 500, seed=7), 3))
        done, _ = stream.until(Finished, "e")
        assert len(done.output_ids) == 3
    finally:
        runner.stop()
    assert runner.engine.pool.used_slots == 0


def test_a_preempt_of_a_prefill_still_queued_is_acknowledged(tiny_llama):
    """A Preempt can reach a prefill that waits behind a decode step; it must be acked, or the
    scheduler would wait on it. The test plays the engine thread before starting it."""
    model = tiny_llama.model
    stream = Stream()
    engine = BatchEngine(model, EngineConfig(chunk_size=16), BatchConfig(4, 4, 160))
    runner = BatchRunner(engine, stream)
    ids = prompt(20, 500, seed=1)
    runner._on_assign((greedy("q", ids, 5), float("inf")))
    runner._on_pause(("q", False))
    acked = stream.events.get_nowait()
    assert isinstance(acked, Preempted) and acked.state_dropped  # it held nothing yet
    runner.assign(greedy("q", ids, 5))  # the scheduler's Assign after a dropped state
    runner.start()
    try:
        done, seen = stream.until(Finished, "q")
    finally:
        runner.stop()
    assert collect_tokens(seen)["q"] == reference(model, ids, 5)[0] == list(done.output_ids)


def test_a_full_batch_makes_room_for_a_row_with_a_tighter_tbt_target(tiny_llama):
    """Two lower-tier rows fill the batch; a critical request that prefills meanwhile takes a
    row at once (one of them waits, its cache kept) and finishes first; every request's tokens
    are still generate's, each streamed once."""
    model = tiny_llama.model
    stream = Stream()
    runner = start(model, stream, batch=2, slots=4)
    prompts = {"b1": prompt(20, 500, seed=1), "b2": prompt(27, 500, seed=2)}
    critical = prompt(15, 500, seed=3)
    try:
        for name, ids in prompts.items():
            runner.assign(greedy(name, ids, 60), tbt_slo_s=5.0)
        events = []
        while stream.counts.get("b2", 0) < 3:  # both rows decoding: the batch is full
            events.append(stream.events.get(timeout=60))
        runner.assign(greedy("c", critical, 6), tbt_slo_s=0.05)
        events += drain(stream, ["b1", "b2", "c"])
    finally:
        runner.stop()
    finished = [e.request_id for e in events if isinstance(e, Finished)]
    assert finished[0] == "c"  # before either lower-tier row, not after one of them
    tokens = collect_tokens(events)
    assert tokens["c"] == reference(model, critical, 6)[0]
    for name, ids in prompts.items():  # the row that made room resumed exactly
        assert tokens[name] == reference(model, ids, 60)[0], name
    assert runner.engine.pool.used_slots == 0 and runner.suspended_bytes == 0


@pytest.mark.parametrize(
    ("tbt_slo_s", "steps_between_prefills"),
    [(3600.0, False), (1e-9, True), (None, True)],
    ids=["rows-not-due", "rows-always-due", "rows-without-target"],
)
def test_while_prefills_wait_the_batch_steps_only_for_rows_that_are_due(
    tiny_llama, tbt_slo_s, steps_between_prefills
):
    """Fewer, fuller steps: a row whose TBT target is far off waits for the queued prefills
    (the slotter would step it when due); one without a target steps between every two."""
    stream = Stream()
    engine = BatchEngine(
        tiny_llama.model,
        EngineConfig(chunk_size=16, check="layer"),
        BatchConfig(max_batch_size=4, pool_slots=6, slot_tokens=160),
    )
    runner = stream.runner = BatchRunner(engine, stream)
    names = ["d", "p1", "p2", "p3"]
    for i, name in enumerate(names):  # all queued before the engine thread starts
        runner.assign(greedy(name, prompt(20 + i, 500, seed=i), 8), tbt_slo_s=tbt_slo_s)
    runner.start()
    try:
        events = drain(stream, names)
    finally:
        runner.stop()
    firsts = [i for i, e in enumerate(events) if isinstance(e, FirstToken)]
    assert [events[i].request_id for i in firsts] == names  # prefilled in order
    between = events[firsts[0] : firsts[-1]]
    assert any(isinstance(e, DecodeStepDone) for e in between) is steps_between_prefills


@pytest.mark.parametrize(("target_s", "goes_first"),
                         [(0.4, True), (5.0, True), (10.0, False), (None, False)],
                         ids=["tighter", "as-tight", "looser", "no-target"])  # fmt: skip
def test_a_prefill_at_least_as_urgent_assigned_during_a_decode_step_runs_before_the_rest(
    tiny_llama, target_s, goes_first
):
    """The assignment arrives while a step of both rows (TBT target 5 s) is inside its second
    layer (sent from the engine thread, so no timing is involved). A prefill of a target at
    least as tight stops the step at the next layer boundary: its first token comes out, then
    the step finishes with its own rows. A looser one, or one without a target, waits for the
    step. Every token is the model's."""
    model = tiny_llama.model
    stream = Stream()
    runner = start(model, stream)
    engine = runner.engine
    ids = {name: prompt(20 + 7 * i, 500, seed=60 + i) for i, name in enumerate(["d1", "d2", "c"])}
    layer = engine._decode_layer
    fired: list[int] = []

    def assign_inside_a_step_of_both(index, step):
        if index == 1 and not fired and len(step.rows) == 2:
            d1 = next(t for t in step.rows if t.request_id == "d1")
            fired.append(len(d1.output_ids))  # the index of the token this step makes for it
            runner.assign(greedy("c", ids["c"], 4), tbt_slo_s=target_s)
        return layer(index, step)

    engine._decode_layer = assign_inside_a_step_of_both
    try:
        for name in ("d1", "d2"):
            runner.assign(greedy(name, ids[name], 8), tbt_slo_s=5.0)
        events = drain(stream, ["d1", "d2", "c"])
    finally:
        runner.stop()
    assert len(fired) == 1
    first_c = next(
        i for i, e in enumerate(events) if isinstance(e, FirstToken) and e.request_id == "c"
    )
    stopped_step = next(
        i for i, e in enumerate(events)
        if isinstance(e, DecodeStepDone) and ("d1", fired[0]) in tokens_made(e)
    )  # fmt: skip
    assert (first_c < stopped_step) is goes_first
    assert "c" not in events[stopped_step].request_ids  # it joined after the step began
    tokens = collect_tokens(events)
    for name, n in (("d1", 8), ("d2", 8), ("c", 4)):
        assert tokens[name] == reference(model, ids[name], n)[0], name


def test_a_prefill_reports_its_own_time_without_the_decode_steps_slotted_into_it(tiny_llama):
    """The scheduler's predictor learns a prefill's reported time, and counts slotted steps
    apart (``decode_batch``). Each step inside the prefill is slowed by 20 ms, so they are
    most of its run: the reported time and the slotted steps together fit in the time from
    its assignment to its first token; a report with the steps inside it would not."""
    stream = Stream()
    runner = start(tiny_llama.model, stream)
    step = runner.engine.decode_step

    def slow_inside_a_prefill(*args, **kwargs):
        if runner._running:
            time.sleep(0.02)
        return step(*args, **kwargs)

    runner.engine.decode_step = slow_inside_a_prefill
    try:
        runner.assign(greedy("d", prompt(20, 500, seed=70), 120), tbt_slo_s=0.001)
        stream.until(FirstToken, "d")
        assigned = time.perf_counter()
        runner.assign(greedy("p", prompt(150, 500, seed=71), 2), tbt_slo_s=0.001)
        first, seen = stream.until(FirstToken, "p")
        drain(stream, ["d", "p"])
    finally:
        runner.stop()
    slotted_s = sum(e.seconds for e in seen if isinstance(e, DecodeStepDone) and e.slotted)
    assert slotted_s >= 0.1  # at least five steps slotted in
    assert first.prefill_busy_s > 0
    assert first.prefill_busy_s + slotted_s <= first.at - assigned


def run_two_requests(model, idle_s: float) -> tuple[BatchEngine, BatchRunner]:
    """A runner that served two requests to the end (the caller stops it)."""
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=16, check="layer"),
        BatchConfig(2, 4, 160, kv_release_idle_s=idle_s),
    )
    stream = Stream()
    stream.runner = runner = BatchRunner(engine, stream).start()
    for name in ("a", "b"):
        ids = prompt(20 + 10 * len(name), model.config.vocab_size, seed=3)
        runner.assign(greedy(name, ids, 4))
    drain(stream, ["a", "b"])
    return engine, runner


def test_a_busy_runner_keeps_freed_kv_memory_committed(tiny_llama):
    """Finished requests' pages stay committed until the engine idles (a later compaction
    copies into them without page faults)."""
    engine, runner = run_two_requests(tiny_llama.model, idle_s=3600.0)
    try:
        assert engine.pool.used_slots == 0
        assert engine.pool.retained_slots >= 2 and engine.pool.allocated_bytes > 0
    finally:
        runner.stop()


def test_an_idle_runner_hands_freed_kv_memory_back(tiny_llama):
    engine, runner = run_two_requests(tiny_llama.model, idle_s=0.05)
    try:
        assert engine.pool.used_slots == 0
        for _ in range(600):  # the engine thread releases on its own; 30 s at most
            if engine.pool.retained_slots == 0:
                break
            time.sleep(0.05)
        assert engine.pool.retained_slots == 0 and engine.pool.allocated_bytes == 0
    finally:
        runner.stop()
