"""OpenAI request bodies -> what to ask the queue service for (``Plan``), or a 400 that says
which parameter is wrong and why.

Supported: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` = 1, ``stream`` with ``stream_options.include_usage``, ``service_tier``. Chat
messages go through the served model's own chat template. Parameters that would change the
answer in a way tierflow does not implement (tools, logprobs, penalties, ``n`` > 1, ...) are
refused rather than ignored; unknown parameters are ignored, as most OpenAI-compatible servers
do.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openai_api.errors import OpenAIError, bad_request
from tierflow.tokenizer import TextTokenizer

MAX_STOPS = 4  # as OpenAI


@dataclass(frozen=True)
class ServedModel:
    """The model the queue service serves, as the OpenAI API names and describes it."""

    name: str
    tokenizer: TextTokenizer
    context: int  # prompt + completion tokens at most
    created: int  # unix seconds (when this service started)


@dataclass(frozen=True)
class Plan:
    """One request, translated: what the queue service is asked for and how to answer."""

    kind: Literal["chat", "completion"]
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    service_tier: str | None


# ---------------------------------------------------------------- the bodies


class _StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    service_tier: str | None = None


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]


class _ChatBody(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class _CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


def _is_off(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}, "none", "auto")


# Parameters tierflow does not implement, refused unless they ask for the default behaviour.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _is_off,
    "functions": _is_off,
    "tool_choice": _is_off,
    "function_call": _is_off,
    "logprobs": _is_off,
    "top_logprobs": _is_off,
    "logit_bias": _is_off,
    "presence_penalty": _is_off,
    "frequency_penalty": _is_off,
    "best_of": lambda v: v in (None, 1),
    "echo": _is_off,
    "suffix": _is_off,
    "audio": _is_off,
    "prediction": _is_off,
    "modalities": lambda v: v in (None, ["text"]),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


def _validate(schema: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", param=str(first["loc"][0])) from None
    for name, is_default in _UNSUPPORTED.items():
        if name in body and not is_default(body[name]):
            raise bad_request(f"{name} is not supported by tierflow", param=name)
    if parsed.n not in (None, 1):
        raise bad_request(f"n must be 1 (one choice per request), got {parsed.n}", param="n")
    return parsed


def check_model(requested: str, served: ServedModel) -> None:
    if requested != served.name:
        raise OpenAIError(
            404,
            f"the model {requested!r} does not exist; this service serves {served.name!r}",
            code="model_not_found",
            param="model",
        )


# ---------------------------------------------------------------- prompts


def chat_prompt_ids(messages: Sequence[_Message], tokenizer: TextTokenizer) -> list[int]:
    if tokenizer.chat_template is None:
        raise bad_request("this model has no chat template: use /v1/completions", param="messages")
    turns = [
        {
            # The built-in templates know system/user/assistant; developer is OpenAI's system.
            "role": "system" if m.role == "developer" else m.role,
            "content": m.content
            if isinstance(m.content, str)
            else "".join(part.text for part in m.content),
        }
        for m in messages
    ]
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True)


def completion_prompt_ids(
    prompt: str | list[int] | list[str] | list[list[int]], tokenizer: TextTokenizer
) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(
                "one prompt per request (a batch of prompts is not supported)", param="prompt"
            )
        prompt = prompt[0]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids or (isinstance(prompt, str) and not prompt.strip()):
        raise bad_request("prompt is empty", param="prompt")
    return ids


# ---------------------------------------------------------------- plans


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise bad_request(f"stop: at most {MAX_STOPS} non-empty strings", param="stop")
    return stops


def _plan(
    kind: Literal["chat", "completion"],
    body: _Common,
    prompt_ids: list[int],
    max_tokens: int | None,
    default_max_tokens: int,
    served: ServedModel,
) -> Plan:
    room = served.context - len(prompt_ids)
    if room < 1:
        raise bad_request(
            f"the prompt has {len(prompt_ids)} tokens: no room left in the model's context of "
            f"{served.context} tokens",
            param="messages" if kind == "chat" else "prompt",
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if include_usage and not body.stream:
        raise bad_request(
            "stream_options is only allowed with stream: true", param="stream_options"
        )
    return Plan(
        kind=kind,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_tokens or min(default_max_tokens, room),
        # OpenAI's defaults: sampling at temperature 1, a fresh seed unless one is given.
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=secrets.randbits(63) if body.seed is None else body.seed,
        stops=_stops(body.stop),
        stream=bool(body.stream),
        include_usage=include_usage,
        service_tier=body.service_tier,
    )


def chat_plan(body: Any, served: ServedModel, default_max_tokens: int) -> Plan:
    parsed: _ChatBody = _validate(_ChatBody, body)
    check_model(parsed.model, served)
    ids = chat_prompt_ids(parsed.messages, served.tokenizer)
    max_tokens = parsed.max_completion_tokens or parsed.max_tokens
    return _plan("chat", parsed, ids, max_tokens, default_max_tokens, served)


def completion_plan(body: Any, served: ServedModel, default_max_tokens: int) -> Plan:
    parsed: _CompletionBody = _validate(_CompletionBody, body)
    check_model(parsed.model, served)
    ids = completion_prompt_ids(parsed.prompt, served.tokenizer)
    return _plan("completion", parsed, ids, parsed.max_tokens, default_max_tokens, served)
