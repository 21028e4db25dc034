"""A model's tokenizer without transformers or torch: the ``tokenizers`` library directly.

The queue service tokenises prompts, decodes tokens and checks lengths; the demo builds chat
prompts. None of that needs the model, so none of it should load torch, which transformers
imports with its tokenizer classes. ``TextTokenizer`` wraps a ``tokenizers.Tokenizer`` with the
little that transformers' tokenizer adds and that we use: special tokens by name, and the chat
template, rendered with jinja2 the way transformers renders it. It is built from the built-in
tokenizer, from a model directory (``tokenizer.json`` + ``tokenizer_config.json``), or from a
GGUF file (``tierflow.gguf_tokenizer``). The unit tests check that it gives the same ids and text
as the worker's transformers tokenizer for the same model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tierflow import builtin_tokenizer


@dataclass(frozen=True)
class TextTokenizer:
    backend: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids, with the special tokens the model's post-processor adds (like bos)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = False) -> TextStream:
        """A decoder for tokens that arrive one at a time (``TextStream``)."""
        return TextStream(self.backend, skip_special_tokens)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False
    ) -> str:
        """The chat template applied to ``messages`` (as transformers' ``tokenize=False``)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _compile(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False
    ) -> list[int]:
        """The chat prompt's ids. The template writes its own special tokens, so none are added
        (transformers does the same)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class TextStream:
    """The text of a growing sequence of tokens, one piece per token (``tokenizers``'
    ``DecodeStream``). Byte-level and byte-fallback tokens can end inside a UTF-8 character:
    such a token gives "" and its bytes come out with the token that completes the character,
    so a piece is never a replacement character ("\ufffd") that the whole text does not have.
    The pieces join to what ``decode`` gives for all the tokens."""

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def builtin() -> TextTokenizer:
    """The project's own tokenizer (``tierflow.builtin_tokenizer``), used by the random presets."""
    return TextTokenizer(
        Tokenizer.from_file(str(builtin_tokenizer.TOKENIZER_PATH)),
        chat_template=builtin_tokenizer.CHAT_TEMPLATE,
        bos_token=builtin_tokenizer.BOS_TOKEN,
        eos_token=builtin_tokenizer.EOS_TOKEN,
        pad_token=builtin_tokenizer.PAD_TOKEN,
    )


def from_directory(path: Path) -> TextTokenizer:
    """A tokenizer saved by transformers: ``tokenizer.json`` holds the whole pipeline (with the
    post-processor transformers set up), ``tokenizer_config.json`` the names of the special
    tokens and, in older saves, the chat template (newer ones write ``chat_template.jinja``)."""
    config = _read_json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is what chats use
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return TextTokenizer(
        Tokenizer.from_file(str(path / "tokenizer.json")),
        chat_template=template,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        pad_token=_token_text(config.get("pad_token")),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: object) -> str | None:
    # transformers writes a special token either as its text or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile(template: str) -> Any:
    # The environment transformers renders chat templates in (utils/chat_template_utils.py):
    # sandboxed, trim_blocks + lstrip_blocks, loop controls, raise_exception, and a tojson that
    # does not HTML-escape. jinja2 is imported here, not at the top: the queue service never
    # renders a chat and so does not need it.
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
