"""The pdllm decode phase (steps 6-7) on SDAR block-diffusion models: the in-process engine's
(``shared/app/engine.py``) and the decode worker's (``decode_service/server.py``), one code path.

Selection (steps 3-5) runs unchanged: chunks are prefilled and scored with the prefill worker's own
attention (causal or bidirectional inside a chunk, not SDAR's block-causal mask). That only decides *which*
chunks are kept; no K/V of it reaches the decode, so selection is a heuristic on SDAR as on any model.

The decode must be exact block diffusion over the selected prompt ``[instruction][BOS c_1]...[BOS c_K]
[query]`` at the decode layout's positions (contiguous: top-B is refused). So:

* Step 6, :func:`build_prefix`: the static KV of ``[instruction, selected chunks]`` is one block-causal
  forward (in pieces of whole model blocks) at positions ``0..``, recorded into a
  :class:`~.block_diffusion.BlockKVCache`: exactly the cache block diffusion records for those positions,
  since under the block-causal mask a token's K/V depend only on its own and earlier blocks. Only whole
  model blocks are kept, and none past the prompt's last whole generation block: the static prefix's last
  partial block must also see the query (and maybe the answer), so it is decoded with them. ``kv_mode``
  full-mask and chunk-query therefore build the same cache (the query and the masked response are in later
  blocks, which earlier blocks never see).
* Step 7: block diffusion over the whole prompt with that cache as its ``prefix``: it records the rest of
  the prompt's whole generation blocks, then decodes block by block, the prompt's partial last block with
  the first answer block, blocks aligned to absolute positions. The result equals plain block diffusion on
  the selected prompt. The decode worker and the in-process engine run it in the batched rounds
  (``block_rounds.py``, the cache in pool pages); the reference loop they are tested against is
  ``tests/reference/sdar.py``.
* Decode policy ``focus`` (FOCUS): step 7 runs FOCUS over each block's window, continuing the same prefix
  (``decode_service/sdar_focus_rounds.py``), so the result equals vanilla FOCUS on the selected prompt, its
  counters in the result's ``cache``. The prefix itself is no FOCUS business: FOCUS only skips rows of each
  block's window, and every finished block is still recorded from its final tokens.

The prefix is always rebuilt from token ids, never taken from K/V another phase made: the prefill worker's
step-3 chunk KV (chunk-local positions, causal or bidirectional inside a chunk) and the decode KV it can
hand off (one bidirectional forward) are not block-causal, and decoding over them would be another model.

Not supported (refused with a ValueError naming the option; the decode worker answers INVALID_ARGUMENT):
``kv_mode="chunk-only"`` (it reuses the step-3 chunk KV), ``top_b`` (holes in the positions break block
alignment), decode policies other than ``none`` and ``focus`` (:data:`POLICIES`; the caching ones and DyLLM
assume full bidirectional attention over every local row), a static-KV decode policy.
"""

from __future__ import annotations

import torch

from pdllm.decode_service.block_diffusion import BlockKVCache, generation_block, prefill_blocks
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import DecodeLayout, Request
from pdllm.shared.model.transformer import DiffusionLM

WHERE = "the pdllm engine on SDAR (block-diffusion) models"
POLICIES = ("none", "focus")
"""The decode policies block diffusion runs (either method)."""


def is_block_diffusion(model: DiffusionLM) -> bool:
    return model.config.block_size is not None


def check_config(config: EngineConfig, gen: GenerationConfig | None, model: DiffusionLM) -> None:
    """Refuse, before any compute, the settings the SDAR decode does not run (see the module docstring)."""
    if config.kv_mode == "chunk-only":
        raise ValueError(
            f"kv_mode='chunk-only' is not supported by {WHERE}: the step-3 chunk KV is not block-causal "
            "at the decode positions (use kv_mode full-mask or chunk-query)"
        )
    if config.top_b is not None:
        raise ValueError(
            f"top_b={config.top_b} is not supported by {WHERE}: dropped tokens leave holes in the "
            "positions that block diffusion aligns its blocks to (leave top_b unset)"
        )
    if gen is not None:
        check_generation(gen, model)


def check_generation(gen: GenerationConfig, model: DiffusionLM) -> None:
    """The generation settings block diffusion runs: valid, ``block_length`` a multiple of the model block."""
    gen.validate()
    generation_block(gen, model.config.block_size or 0)


def check_decode_options(
    decode_policy: DecodePolicyConfig | None, static_policy: object | None, where: str = WHERE
) -> None:
    if decode_policy is not None and decode_policy.name not in POLICIES:
        raise ValueError(
            f"decode policy {decode_policy.name!r} is not supported by {where} (use focus or none)"
        )
    if static_policy is not None:
        raise ValueError(f"a static-KV decode policy is not supported by {where}")


def selected_prompt(request: Request, layout: DecodeLayout) -> list[int]:
    """``[instruction][BOS c_i for the selected chunks, document order][query]``: the decode layout's tokens
    at positions ``0..`` (contiguous without top-B)."""
    ids = list(request.instruction)
    for i in layout.chunk_ids:
        ids += request.chunks[i]
    return ids + list(request.query)


@torch.inference_mode()
def build_prefix(
    model: DiffusionLM, request: Request, layout: DecodeLayout, gen: GenerationConfig
) -> BlockKVCache:
    """Step 6: the block-causal K/V of the static prefix's whole model blocks (not past the prompt's last
    whole generation block), in a cache sized for prompt + answer."""
    model_block = model.config.block_size
    assert model_block is not None, "build_prefix needs a block-diffusion model"
    block = generation_block(gen, model_block)
    prompt_len = layout.static_len + layout.query_len
    end = min(layout.static_len // model_block * model_block, prompt_len // block * block)
    seq = selected_prompt_tensor(model, request, layout)[:end]
    cache = BlockKVCache(prompt_len + gen.gen_length, model_block)
    prefill_blocks(model, cache, seq, end)
    return cache


def selected_prompt_tensor(model: DiffusionLM, request: Request, layout: DecodeLayout) -> torch.Tensor:
    """:func:`selected_prompt` on the model's device."""
    device = next(model.parameters()).device
    return torch.tensor(selected_prompt(request, layout), dtype=torch.long, device=device)
