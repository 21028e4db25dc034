"""The built-in tokenizer: a byte-level BPE that needs no download.

Machines here cannot reach a model hub, yet the random-weight presets (``tierflow.catalogue``)
need a real tokenizer so that prompts are text and token counts are realistic. This module ships
one: a byte-level BPE (vocab 4096) trained offline on ``tierflow/assets/corpus.txt``, a small
English and code corpus written for the project. The trained ``tierflow/assets/tokenizer.json`` is
committed; ``python -m tierflow.builtin_tokenizer --train`` reproduces it byte for byte from the
corpus, and ``--check`` says whether the committed file is still what the corpus gives.

It lives in the shared package because both sides read it: the queue service through
``tierflow.tokenizer`` (no torch), the worker as a transformers tokenizer (``worker.models``).
Training needs only the ``tokenizers`` library.

Byte-level means every string round-trips, whatever its characters: unseen words just cost more
tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS / "corpus.txt"
TOKENIZER_PATH = ASSETS / "tokenizer.json"

VOCAB_SIZE = 4096
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: pad=0, bos=1, eos=2, im_start=3, im_end=4.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

# ChatML-style, like many real instruct models, so chat prompts have a realistic shape. The bos
# token is written by the template (transformers tokenizes chat text with add_special_tokens=False).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(corpus: str, *, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on ``corpus``. Deterministic: same corpus, same tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text encodes even if a byte never occurs in the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    # Plain ``encode`` prepends bos, as Llama-family tokenizers do; chat templates write their own.
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def trained_json() -> str:
    """The tokenizer JSON that the shipped corpus produces (what ``--train`` writes)."""
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    return train_tokenizer(corpus).to_str(pretty=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tierflow.builtin_tokenizer", description=__doc__
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--train", action="store_true", help=f"rewrite {TOKENIZER_PATH.name}")
    group.add_argument("--check", action="store_true", help="exit 1 if it is out of date")
    args = parser.parse_args(argv)
    text = trained_json()
    if args.train:
        TOKENIZER_PATH.write_text(text, encoding="utf-8")
        vocab = Tokenizer.from_str(text).get_vocab_size()
        print(f"wrote {TOKENIZER_PATH} (vocab {vocab})")
        return 0
    current = TOKENIZER_PATH.read_text(encoding="utf-8") if TOKENIZER_PATH.exists() else ""
    if current != text:
        print(f"{TOKENIZER_PATH} is out of date: run python -m tierflow.builtin_tokenizer --train")
        return 1
    print(f"{TOKENIZER_PATH} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
