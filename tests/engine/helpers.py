"""Shared fixtures of the engine tests: tiny random models and token streams (fp32, CPU)."""

from __future__ import annotations

import torch

from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.model.transformer import DiffusionLM
from tests.model.helpers import tiny_model

VOCAB_LO, VOCAB_HI = 3, 90  # clear of pad/bos/eos (0-2) and the mask id (96)


def model(family: str, seed: int = 0) -> DiffusionLM:
    return tiny_model(family, seed)


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LO, VOCAB_HI, (n,), generator=gen).tolist()


@torch.inference_mode()
def greedy_continuation(m: DiffusionLM, prefix: list[int], n: int) -> list[int]:
    """The model's own most likely causal continuation of ``prefix`` (used to plant a relevant chunk)."""
    seq = list(prefix)
    for _ in range(n):
        hidden = m.hidden_states(torch.tensor([seq]), attention=DenseAttention(causal=True))[0]
        logits = m.lm_head(hidden[-1])
        logits[m.config.mask_token_id] = float("-inf")
        seq.append(int(logits.argmax()))
    return seq[len(prefix) :]
