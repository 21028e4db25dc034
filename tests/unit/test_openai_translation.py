"""The OpenAI translation, module by module, without services: request validation and prompts
(translate), the service_tier rules (service_tiers), stop strings (stops), the documents and
chunks (render), event handling (generation, over a scripted call) and gRPC -> HTTP errors."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from openai_api.errors import OpenAIError, from_grpc
from openai_api.generation import KEEP_ALIVE, Generation, Usage
from openai_api.render import DONE_EVENT, Renderer
from openai_api.service_tiers import ServiceTiers
from openai_api.stops import StopScanner
from openai_api.translate import ServedModel, chat_plan, completion_plan
from tests.tiers import UNIT_TIERS
from tierflow.tokenizer import builtin
from tierflow.v1 import serving_pb2

SERVED = ServedModel("tiny", builtin(), context=64, created=0)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def refusal(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        fn(*args)
    return err.value


# ---------------------------------------------------------------- translate


def test_chat_plan_uses_the_chat_template_and_openai_defaults():
    plan = chat_plan(CHAT, SERVED, 1024)
    expected = SERVED.tokenizer.render_chat(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert SERVED.tokenizer.decode(plan.prompt_ids) == expected
    assert plan.max_new_tokens == SERVED.context - len(plan.prompt_ids)  # clamped to the room
    assert (plan.temperature, plan.top_p, plan.stream, plan.stops) == (1.0, 1.0, False, ())
    assert plan.seed != chat_plan(CHAT, SERVED, 1024).seed  # a fresh seed when none is given
    parts = CHAT | {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}],
            },
        ],
        "max_completion_tokens": 5,
        "max_tokens": 9,
        "temperature": 0,
        "seed": 7,
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": True},
        "service_tier": "flex",
        "user": "ignored",  # unknown or harmless parameters are ignored
        "presence_penalty": 0,
    }
    plan = chat_plan(parts, SERVED, 1024)
    assert "<|im_start|>system\nbe brief" in SERVED.tokenizer.decode(plan.prompt_ids)
    assert "<|im_start|>user\nhi<|im_end|>" in SERVED.tokenizer.decode(plan.prompt_ids)
    assert (plan.max_new_tokens, plan.temperature, plan.seed, plan.stops) == (5, 0.0, 7, ("\n",))
    assert plan.include_usage and plan.service_tier == "flex"


def test_completion_prompts_text_ids_and_lists_of_one():
    text = completion_plan({"model": "tiny", "prompt": "hello"}, SERVED, 16)
    assert list(text.prompt_ids) == SERVED.tokenizer.encode("hello")
    assert text.max_new_tokens == 16
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        plan = completion_plan({"model": "tiny", "prompt": prompt, "max_tokens": 3}, SERVED, 16)
        assert plan.prompt_ids == (5, 6, 7) and plan.max_new_tokens == 3
    assert completion_plan({"model": "tiny", "prompt": ["hello"]}, SERVED, 16).prompt_ids == (
        text.prompt_ids
    )


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"model": ""}, "model"),
        ({"messages": [{"role": "user", "content": "word " * 100}]}, "messages"),  # > context
    ],
)
def test_bad_chat_parameters_are_400_naming_the_parameter(change, param):
    error = refusal(chat_plan, CHAT | change, SERVED, 1024)
    assert (error.status, error.param) == (400, param), error.message


def test_bad_completion_prompts_and_unknown_model():
    for prompt in ("", "   ", [], ["a", "b"]):
        error = refusal(completion_plan, {"model": "tiny", "prompt": prompt}, SERVED, 16)
        assert (error.status, error.param) == (400, "prompt"), prompt
    error = refusal(chat_plan, CHAT | {"model": "gpt-4o"}, SERVED, 16)
    assert (error.status, error.code) == (404, "model_not_found")
    assert refusal(chat_plan, ["not", "an", "object"], SERVED, 16).status == 400


# ---------------------------------------------------------------- service tiers


def test_service_tier_may_lower_never_raise():
    tiers = ServiceTiers(UNIT_TIERS)
    assert tiers.resolve("standard", None) == "standard"
    assert tiers.resolve("standard", "auto") == "standard"
    assert tiers.resolve("standard", "default") == "standard"
    assert tiers.resolve("standard", "flex") == "batch"
    assert tiers.resolve("critical", "batch") == "batch"  # tier names work too
    error = refusal(tiers.resolve, "standard", "priority")
    assert (error.status, error.code, error.param) == (403, "tier_not_allowed", "service_tier")
    assert refusal(tiers.resolve, "batch", "critical").status == 403
    assert refusal(tiers.resolve, "critical", "gold").status == 400
    assert refusal(tiers.resolve, None, None).status == 401  # not through the edge
    assert refusal(tiers.resolve, "internal", None).status == 403
    assert [tiers.openai_name(t) for t in UNIT_TIERS.names] == ["priority", "default", "flex"]
    with pytest.raises(ValueError, match="not in the tier table"):
        ServiceTiers(UNIT_TIERS, {"priority": "gold"})


# ---------------------------------------------------------------- stops


def test_stop_strings_spanning_pieces_are_cut_and_held_back_meanwhile():
    scanner = StopScanner(["END", "\n\n"])
    assert scanner.feed("hello E") == "hello "  # "E" may start "END": held back
    assert scanner.feed("x") == "Ex"
    assert scanner.feed("EN") == ""
    assert scanner.feed("Dmore") == "" and scanner.hit
    other = StopScanner(["END"])
    assert other.feed("abc EN") == "abc " and other.flush() == "EN" and not other.hit
    assert StopScanner([]).feed("anything") == "anything"
    first = StopScanner(["b", "abc"])
    assert first.feed("xxabc") == "xx" and first.hit  # the earliest stop wins


# ---------------------------------------------------------------- render


def parse_sse(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: ") :])


def test_chat_chunks_and_documents_have_openai_shape():
    chat = Renderer("chat", "r1", "tiny", "priority", include_usage=True, created=5)
    first = parse_sse(chat.chunk(role=True))
    assert first["id"] == "chatcmpl-r1" and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None and first["service_tier"] == "priority"
    assert parse_sse(chat.chunk("Par"))["choices"][0]["delta"] == {"content": "Par"}
    last = parse_sse(chat.chunk(finish_reason="stop"))["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"
    usage = parse_sse(chat.usage_chunk(Usage(7, 2)))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
    }
    whole = chat.response("Paris", "stop", Usage(7, 2))
    assert whole["object"] == "chat.completion" and whole["created"] == 5
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Paris",
        "refusal": None,
    }
    completion = Renderer("completion", "r2", "tiny", "flex")
    chunk = parse_sse(completion.chunk("x"))
    assert chunk["id"] == "cmpl-r2" and chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == "x" and "usage" not in chunk
    assert completion.response("x", "length", Usage(1, 1))["choices"][0]["text"] == "x"
    error = parse_sse(Renderer.error_event(OpenAIError(503, "down", code="queue_unavailable")))
    assert error["error"]["code"] == "queue_unavailable"
    assert DONE_EVENT == "data: [DONE]\n\n"


# ---------------------------------------------------------------- errors


def test_grpc_statuses_become_openai_statuses():
    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
        grpc.StatusCode.INTERNAL: 500,
    }
    for code, status in cases.items():
        error = from_grpc(code, "why", retry_after_s=5)
        assert error.status == status and "why" in error.message
        assert error.body()["error"]["message"] == error.message
        assert ("retry-after" in error.headers) == (status in (429, 503))


# ---------------------------------------------------------------- generation


class ScriptedCall:
    """Stands in for a grpc.aio Generate call: its events, then EOF or an error."""

    def __init__(self, events, error: grpc.StatusCode | None = None, trailers=()) -> None:
        self.events = list(events)
        self.error = error
        self.trailers = grpc.aio.Metadata(*trailers)
        self.cancelled = False

    async def read(self):
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise grpc.aio.AioRpcError(
                self.error, grpc.aio.Metadata(), self.trailers, details="overloaded"
            )
        return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def event(**kw) -> serving_pb2.GenerateEvent:
    return serving_pb2.GenerateEvent(request_id="r", **kw)


QUEUED = event(queued=serving_pb2.Queued(tier="batch", prompt_tokens=3))
PROGRESS = event(progress=serving_pb2.PrefillProgress(tokens_done=3, prompt_tokens=3))
TOKENS = [
    event(first_token=serving_pb2.FirstToken(token_id=1, text="Hel")),
    event(token=serving_pb2.Token(token_id=2, text="lo, ")),
    event(token=serving_pb2.Token(token_id=3, text="world")),
]
DONE = event(
    done=serving_pb2.Done(
        usage=serving_pb2.Usage(prompt_tokens=3, completion_tokens=3),
        text="Hello, world",
        finish_reason="length",
    )
)


def run(coro):
    return asyncio.run(coro)


def test_generation_starts_when_running_and_streams_pieces():
    async def go():
        generation = Generation(
            ScriptedCall([QUEUED, PROGRESS, *TOKENS, DONE]), (), retry_after_s=5
        )
        await generation.start()
        assert generation.tier == "batch"
        return generation, [p async for p in generation.pieces()]

    generation, pieces = run(go())
    assert pieces == ["Hel", "lo, ", "world"] and generation.finish_reason == "length"
    assert generation.usage == Usage(3, 3)


def test_generation_stop_string_cancels_the_call():
    async def go():
        call = ScriptedCall([QUEUED, *TOKENS, DONE])
        generation = Generation(call, (", w",), retry_after_s=5)
        return call, generation, await generation.text()  # starts it too

    call, generation, text = run(go())
    assert text == "Hello" and generation.finish_reason == "stop" and call.cancelled
    assert generation.usage == Usage(3, 3)  # Queued's prompt, tokens so far (no Done)
    assert generation.tier == "batch"


def test_generation_refused_after_queued_is_an_openai_error():
    async def go():
        generation = Generation(
            ScriptedCall([QUEUED], grpc.StatusCode.RESOURCE_EXHAUSTED), (), retry_after_s=5
        )
        await generation.start()

    with pytest.raises(OpenAIError) as err:
        run(go())
    assert err.value.status == 429 and err.value.headers == {"retry-after": "5"}


def test_a_refusal_at_capacity_carries_the_queue_services_own_time_to_retry():
    async def go():
        call = ScriptedCall([], grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after", "7"),))
        await Generation(call, (), retry_after_s=5).start()

    with pytest.raises(OpenAIError) as err:
        run(go())
    assert err.value.status == 429 and err.value.headers == {"retry-after": "7"}


def test_a_downgraded_request_names_both_tiers_and_a_long_wait_keeps_the_stream_alive():
    downgraded = event(queued=serving_pb2.Queued(tier="standard", requested_tier="critical"))
    waiting = event(still_waiting=serving_pb2.StillWaiting(waited_ms=10_000))

    async def go():
        generation = Generation(
            ScriptedCall([downgraded, waiting, waiting, *TOKENS, DONE]), (), retry_after_s=5
        )
        await generation.start()  # a heartbeat starts the response: nothing to refuse it now
        return generation, [p async for p in generation.pieces()]

    generation, pieces = run(go())
    assert (generation.tier, generation.requested_tier) == ("standard", "critical")
    assert pieces == [KEEP_ALIVE, KEEP_ALIVE, "Hel", "lo, ", "world"]
    assert KEEP_ALIVE == ""  # joined into the text, it adds nothing
