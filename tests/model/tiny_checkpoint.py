"""A tiny random checkpoint directory with a real (small) tokenizer, for CLI and service tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdllm.shared.model.loader import save_checkpoint
from pdllm.shared.model.transformer import DiffusionLM

from .helpers import tiny_config

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[MASK]"]
CORPUS = [
    "The access code of Mira Halden is 4821.",
    "Question: What is the access code of Mira Halden?\nAnswer: 4821",
    "The archive reopened after a two-year renovation of the reading room.",
    "Letters, maps and oral histories from local residents 0123456789.",
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", mask_token="[MASK]"
    )


def make_tiny_checkpoint(out: Path, family: str = "dream", seed: int = 0) -> Path:
    tokenizer = make_tokenizer()
    config = tiny_config(
        family,
        vocab_size=len(tokenizer),
        mask_token_id=tokenizer.mask_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=4096,
    )
    model = DiffusionLM(config)
    model.init_weights(seed, std=0.2)
    return save_checkpoint(model, out, tokenizer)
