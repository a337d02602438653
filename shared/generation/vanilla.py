"""Vanilla masked-diffusion generation: every step re-encodes prompt + response, no cache.

This is the quality reference and the baseline every speedup is measured against; keep it plain. A decode
policy (``policies``, e.g. Fast-dLLM's dual cache) runs the same loop reusing the KV of some rows instead.
"""

from __future__ import annotations

import torch

from ..model.attention import DenseAttention
from ..model.transformer import DiffusionLM
from .block_diffusion import generate_block_diffusion
from .policies import CachePolicy, DecodePolicyConfig, PolicyLogits, make_policy, run_policy
from .policies.base import vanilla_local_rows
from .policies.compute_skip import generate_compute_skip_sdar, run_compute_skip, vanilla_compute_skip_logits
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


def vanilla_policy_logits(
    model: DiffusionLM, prompt: torch.Tensor, config: GenerationConfig, policy: CachePolicy
) -> PolicyLogits:
    """The vanilla step under a decode policy: the local rows are prompt + response (dense attention over
    them, no static KV). ``generate_vanilla`` and the decode worker's vanilla sessions both start here."""
    local, positions = vanilla_local_rows(model.config.mask_token_id, prompt, config)
    return PolicyLogits(model, local, positions, prompt.numel(), config, policy, DenseAttention())


@torch.inference_mode()
def generate_vanilla(
    model: DiffusionLM,
    prompt_ids: torch.Tensor | list[int],
    config: GenerationConfig,
    progress: bool = False,
    policy: DecodePolicyConfig | None = None,
) -> GenerationResult:
    """Generate ``config.gen_length`` tokens after ``prompt_ids`` (1-D) with full bidirectional attention;
    ``policy``: a decode policy over prompt + response (None or ``none``: every step recomputes all).
    Block-diffusion models (SDAR) decode block by block over their exact cache (``block_diffusion``)."""
    prompt = prompt_tensor(model, prompt_ids)
    config.validate()
    cache_policy = make_policy(policy) if policy is not None else None
    skips = policy is not None and policy.skips_compute
    if model.config.block_size is not None:
        # Block diffusion (SDAR): full attention would be the wrong model; decode block by block instead.
        if skips and policy is not None:
            return generate_compute_skip_sdar(model, prompt, config, policy, progress)
        if cache_policy is not None and policy is not None:
            raise ValueError(
                f"decode policy {policy.name!r} does not run on SDAR (block-diffusion) "
                "models yet: their vanilla decoding already keeps the exact cache of finished blocks; "
                "use --decode-policy focus or none"
            )
        return generate_block_diffusion(model, prompt, config, progress)
    if skips and policy is not None:
        return run_compute_skip(vanilla_compute_skip_logits(model, prompt, config, policy), progress)
    if cache_policy is not None:
        return run_policy(vanilla_policy_logits(model, prompt, config, cache_policy), progress)
    return denoise(
        config,
        mask_id=model.config.mask_token_id,
        eos_id=model.config.eos_token_id,
        logits_fn=vanilla_logits_fn(model, prompt, config.gen_length),
        device=prompt.device,
        progress=progress,
    )
