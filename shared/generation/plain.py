"""The plain vanilla loop: every step re-encodes prompt + response with full attention, no cache.

The quality reference and the baseline every speedup is measured against; keep it plain. The decode worker
runs vanilla requests in its batched rounds (``DecodeWorker.vanilla``), under a decode policy too, and SDAR
models block by block.
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
def generate_plain(
    model: DiffusionLM, prompt_ids: torch.Tensor | list[int], config: GenerationConfig, progress: bool = False
) -> GenerationResult:
    """Generate ``config.gen_length`` tokens after ``prompt_ids`` (1-D), every step recomputing all rows.
    Full attention only: block-diffusion (SDAR) models decode block by block (``DecodeWorker.vanilla``)."""
    prompt = prompt_tensor(model, prompt_ids)
    config.validate()
    if model.config.block_size is not None:
        raise ValueError(
            f"{model.config.family!r} is a block-diffusion model: the plain loop runs full attention; "
            "decode it block by block (pdllm.decode_service.worker.DecodeWorker.vanilla)"
        )
    return denoise_plain(model, prompt, config, progress)


def denoise_plain(
    model: DiffusionLM, prompt: torch.Tensor, config: GenerationConfig, progress: bool = False
) -> GenerationResult:
    """The plain loop over a prompt tensor already on the model's device (``prompt_tensor``)."""
    return denoise(
        config,
        mask_id=model.config.mask_token_id,
        eos_id=model.config.eos_token_id,
        logits_fn=vanilla_logits_fn(model, prompt, config.gen_length),
        device=prompt.device,
        progress=progress,
    )
