"""Vanilla generation under a decode policy, one request (the reference): the plain loop
(``shared/generation/plain.py``), a decode policy's loop over prompt + response (``policy.py``, e.g.
Fast-dLLM's dual cache), or SDAR's block-by-block decoding (``tests/reference/block_diffusion.py``). The
decode worker's vanilla sessions (``DecodeWorker.vanilla``, in the batched rounds) are held to it token for
token.
"""

from __future__ import annotations

import torch

from pdllm.decode_service.policies import CachePolicy, DecodePolicyConfig, make_policy
from pdllm.shared.generation.plain import denoise_plain, prompt_tensor
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.block_diffusion import generate_block_diffusion
from tests.reference.compute_skip import (
    generate_compute_skip_sdar,
    run_compute_skip,
    vanilla_compute_skip_logits,
)
from tests.reference.policy import PolicyLogits, run_policy, vanilla_local_rows


def vanilla_policy_logits(
    model: DiffusionLM, prompt: torch.Tensor, config: GenerationConfig, policy: CachePolicy
) -> PolicyLogits:
    """The vanilla step under a decode policy: the local rows are prompt + response (dense attention over
    them, no static KV)."""
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
    return denoise_plain(model, prompt, config, progress)
