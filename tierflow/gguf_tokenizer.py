"""The tokenizer and limits described by a GGUF file's metadata, read without torch.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types and special
token ids under llama.cpp's key names. transformers rebuilds a tokenizer from them when it
converts the file (``worker.models.ensure_converted``), but that needs torch; the queue service
only needs the tokenizer, so this rebuilds the same one with the ``tokenizers`` library, read
with the ``gguf`` package (numpy only). Only what the presets ship is supported: a byte-level BPE
(``tokenizer.ggml.model == "gpt2"``) split the GPT-2 way. The unit tests compare it with the
tokenizer of the converted model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from tierflow.tokenizer import TextTokenizer

_CONTROL = 3  # llama.cpp's token type of a control (special) token


@dataclass(frozen=True)
class GgufTokenizerInfo:
    tokenizer: TextTokenizer
    vocab_size: int
    context_length: int


def read_gguf_tokenizer(path: Path) -> GgufTokenizerInfo:
    """Raises ValueError when the file describes a tokenizer this module cannot rebuild."""
    from gguf import GGUFReader  # numpy only; imported here so that importing this is free

    fields = GGUFReader(str(path)).fields

    def value(key: str, default: object = None) -> object:
        field = fields.get(key)
        return default if field is None else field.contents()

    kind, split = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre")
    if kind != "gpt2" or split not in {None, "default", "gpt2", "smollm"}:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} (pre-tokenizer {split!r})")
    tokens: list[str] = value("tokenizer.ggml.tokens")
    backend = _byte_level_bpe(tokens, value("tokenizer.ggml.merges"))
    types = value("tokenizer.ggml.token_type") or []
    alphabet = set(_bytes_to_unicode().values())
    # As transformers does: control tokens stay whole; one spelled outside the byte alphabet is
    # a llama.cpp mislabel and is left out (it would grow the vocabulary).
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, types, strict=False)
            if kind == _CONTROL and set(token) <= alphabet
        ]
    )

    def special(key: str) -> str | None:
        token_id = value(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    architecture = value("general.architecture")
    return GgufTokenizerInfo(
        TextTokenizer(
            backend,
            chat_template=value("tokenizer.chat_template"),
            bos_token=special("bos_token_id"),
            eos_token=special("eos_token_id"),
            pad_token=special("padding_token_id"),
        ),
        vocab_size=int(value(f"{architecture}.vocab_size", len(tokens))),
        context_length=int(value(f"{architecture}.context_length")),
    )


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> Tokenizer:
    # What transformers' GPT2Tokenizer builds: tokens written in the byte alphabet, no prefix
    # space, and a post-processor that adds nothing (add_bos_token is off for GPT-2 BPEs).
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ")) for merge in merges],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    return backend


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (byte-level BPE's spelling)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
