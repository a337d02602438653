"""Vanilla masked-diffusion generation: every step re-encodes prompt + response, no cache.

This is the quality reference and the baseline every speedup is measured against; keep it plain.
"""

from __future__ import annotations

import torch

from ..model.transformer import DiffusionLM
from .sampler import GenerationConfig, GenerationResult, denoise


@torch.inference_mode()
def generate_vanilla(
    model: DiffusionLM,
    prompt_ids: torch.Tensor | list[int],
    config: GenerationConfig,
    progress: bool = False,
) -> GenerationResult:
    """Generate ``config.gen_length`` tokens after ``prompt_ids`` (1-D) with full bidirectional attention."""
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()
    if prompt.numel() == 0:
        raise ValueError("prompt is empty: vanilla generation needs at least one prompt token")
    config.validate()
    p = prompt.numel()
    seq = torch.cat([prompt, torch.empty(config.gen_length, dtype=torch.long, device=device)])

    def logits_fn(response: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seq[p:] = response
        return model(seq[None], logits_at=(positions + p)[None])[0]

    return denoise(
        config,
        mask_id=model.config.mask_token_id,
        eos_id=model.config.eos_token_id,
        logits_fn=logits_fn,
        device=device,
        progress=progress,
    )
