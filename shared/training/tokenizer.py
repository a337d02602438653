"""The shipped model's tokenizer: byte-level BPE, 4K vocabulary, digits split one by one.

Digits are isolated before BPE so that every number is a sequence of single-digit tokens: the answers of
the retrieval tasks are numbers, and copying them digit by digit is what a small model can learn. Byte
level means no input is ever out of vocabulary. The result is saved as a ``PreTrainedTokenizerFast`` so
``AutoTokenizer.from_pretrained(dir)`` loads it with its special tokens set.

Build (deterministic, committed): ``python -m pdllm.shared.training.tokenizer``.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import read_haystack, sentence_texts

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
PAD, BOS, EOS, MASK = "[PAD]", "[BOS]", "[EOS]", "[MASK]"
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK]
VOCAB_SIZE = 4096


def _training_texts(seed: int) -> Iterator[str]:
    from ..eval.tasks import TASKS, render_task_text

    yield from sentence_texts(read_haystack())
    rng = random.Random(seed)
    # Task sentences weigh in so that the templates' words become single tokens.
    for i in range(6000):
        yield render_task_text(TASKS[i % len(TASKS)], rng)


def train_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0):
    """Train the BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        mask_token=MASK,
        pad_token=PAD,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json (build with `python -m pdllm.shared.training.tokenizer`)"
        )
    return AutoTokenizer.from_pretrained(str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the shipped model's BPE tokenizer")
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    tok = train_tokenizer(args.vocab_size)
    tok.save_pretrained(str(args.out))
    print(f"saved {len(tok)} tokens to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
