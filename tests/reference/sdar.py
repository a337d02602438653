"""pdllm's step 7 on SDAR (block-diffusion) models, one request (the reference): block diffusion over the
selected prompt continuing the block-causal prefix that ``decode_service/sdar_decode.build_prefix`` records,
plain or under FOCUS (its session over the same prefix, its counters in the result's ``cache``). The
decode worker and the in-process engine run it in the batched rounds (``decode_service/block_rounds.py``,
``sdar_focus_rounds.py``), held to this loop token for token.
"""

from __future__ import annotations

import torch

from pdllm.decode_service.block_diffusion import BlockKVCache
from pdllm.decode_service.sdar_decode import check_decode_options, selected_prompt_tensor
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.layout import DecodeLayout, Request
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.block_diffusion import BlockDiffusionSession, run_to_end
from tests.reference.compute_skip import compute_skip_sdar_session


def block_session(
    model: DiffusionLM,
    prompt: torch.Tensor,
    gen: GenerationConfig,
    decode_policy: DecodePolicyConfig | None = None,
    prefix: BlockKVCache | None = None,
) -> BlockDiffusionSession:
    """Block diffusion of ``prompt`` under ``decode_policy`` (None or ``none``: plain; ``focus``: FOCUS's
    session, its counters in the result's ``cache``), continuing ``prefix`` when given: pdllm's step 7 here;
    without it, vanilla block diffusion (as ``generate_vanilla``)."""
    check_decode_options(decode_policy, None, "block diffusion on SDAR models")
    if decode_policy is not None and decode_policy.skips_compute:
        return compute_skip_sdar_session(model, prompt, gen, decode_policy, prefix)
    return BlockDiffusionSession(model, prompt, gen, prefix=prefix)


def decode(
    model: DiffusionLM,
    request: Request,
    layout: DecodeLayout,
    prefix: BlockKVCache,
    gen: GenerationConfig,
    progress: bool = False,
    decode_policy: DecodePolicyConfig | None = None,
) -> GenerationResult:
    """Step 7 to the end: block diffusion over the selected prompt under ``decode_policy``, continuing
    ``prefix`` (filled further in place)."""
    prompt = selected_prompt_tensor(model, request, layout)
    return run_to_end(block_session(model, prompt, gen, decode_policy, prefix), gen, progress)
