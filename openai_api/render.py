"""OpenAI's response documents: a chat completion or a text completion, whole or as
server-sent events (one ``data: <chunk>`` per piece of text, then a chunk with the finish
reason, the usage chunk when ``stream_options.include_usage`` asked for it, and
``data: [DONE]``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from openai_api.errors import OpenAIError
from openai_api.generation import Usage

DONE_EVENT = "data: [DONE]\n\n"


def sse(document: dict[str, Any]) -> str:
    return f"data: {json.dumps(document, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Renderer:
    kind: Literal["chat", "completion"]
    request_id: str
    model: str
    service_tier: str  # the tier that served it, in OpenAI's terms where it has a name there
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"

    def _envelope(self, object_: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "service_tier": self.service_tier,
            "system_fingerprint": None,
        }

    # ------------------------------------------------------------ whole responses

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            document = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            document = self._envelope("text_completion")
        return document | {"choices": [choice], "usage": usage.as_dict()}

    # ------------------------------------------------------------ streamed chunks

    def chunk(self, text: str = "", *, role: bool = False, finish_reason: str | None = None) -> str:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            document = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            document = self._envelope("text_completion")
        document["choices"] = [choice]
        if self.include_usage:
            document["usage"] = None  # as OpenAI: only the last chunk carries it
        return sse(document)

    def usage_chunk(self, usage: Usage) -> str:
        object_ = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse(self._envelope(object_) | {"choices": [], "usage": usage.as_dict()})

    @staticmethod
    def error_event(error: OpenAIError) -> str:
        """A failure after the stream started (the status is already 200): OpenAI's SDKs
        raise on a chunk that carries ``error``."""
        return sse(error.body())
