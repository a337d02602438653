"""Vanilla masked-diffusion generation: every step re-encodes prompt + response, no cache.

This is the quality reference and the baseline every speedup is measured against; keep it plain.
"""

from __future__ import annotations

import torch

from ..model.transformer import DiffusionLM
from .sampler import GenerationConfig, GenerationResult, LogitsFn, denoise


def vanilla_logits_fn(model: DiffusionLM, prompt: torch.Tensor, gen_length: int) -> LogitsFn:
    """Logits for the response positions given the whole prompt, recomputed from scratch every call."""
    p = prompt.numel()
    seq = torch.cat([prompt, torch.empty(gen_length, dtype=torch.long, device=prompt.device)])

    def logits_fn(response: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seq[p:] = response
        return model(seq[None], logits_at=(positions + p)[None])[0]

    return logits_fn


def prompt_tensor(model: DiffusionLM, prompt_ids: torch.Tensor | list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()
    if prompt.numel() == 0:
        raise ValueError("prompt is empty: vanilla generation needs at least one prompt token")
    return prompt


@torch.inference_mode()
def generate_vanilla(
    model: DiffusionLM,
    prompt_ids: torch.Tensor | list[int],
    config: GenerationConfig,
    progress: bool = False,
) -> GenerationResult:
    """Generate ``config.gen_length`` tokens after ``prompt_ids`` (1-D) with full bidirectional attention."""
    prompt = prompt_tensor(model, prompt_ids)
    config.validate()
    return denoise(
        config,
        mask_id=model.config.mask_token_id,
        eos_id=model.config.eos_token_id,
        logits_fn=vanilla_logits_fn(model, prompt, config.gen_length),
        device=prompt.device,
        progress=progress,
    )
