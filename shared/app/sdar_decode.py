"""The pdllm engine's decode phase (steps 6-7) on SDAR block-diffusion models (issue 18, in process).

Selection (steps 3-5) runs unchanged: chunks are prefilled and scored with the prefill worker's own
attention (causal or bidirectional inside a chunk, not SDAR's block-causal mask). That only decides *which*
chunks are kept; no K/V of it reaches the decode, so selection is a heuristic on SDAR as on any model.

The decode must be exact block diffusion over the selected prompt ``[instruction][BOS c_1]...[BOS c_K]
[query]`` at the decode layout's positions (contiguous: top-B is refused). So:

* Step 6, :func:`build_prefix`: the static KV of ``[instruction, selected chunks]`` is one block-causal
  forward (in pieces of whole model blocks) at positions ``0..``, recorded into a
  :class:`~pdllm.shared.generation.block_diffusion.BlockKVCache`: exactly the cache block diffusion records
  for those positions, since under the block-causal mask a token's K/V depend only on its own and earlier
  blocks. Only whole model blocks are kept, and none past the prompt's last whole generation block: the
  static prefix's last partial block must also see the query (and maybe the answer), so it is decoded with
  them. ``kv_mode`` full-mask and chunk-query therefore build the same cache (the query and the masked
  response are in later blocks, which earlier blocks never see).
* Step 7, :func:`decode`: :func:`~pdllm.shared.generation.block_diffusion.generate_block_diffusion` over the
  whole prompt with that cache as its ``prefix``: it records the rest of the prompt's whole generation
  blocks, then decodes block by block, the prompt's partial last block with the first answer block, blocks
  aligned to absolute positions. The result equals plain block diffusion on the selected prompt.

Not supported here (refused with a ValueError naming the option): ``kv_mode="chunk-only"`` (the step-3 chunk
KV is not block-causal at decode positions), ``top_b`` (holes in the positions break block alignment),
decode policies, CUDA graphs. The decode worker / server, and so ``serve`` and ``eval``, still refuse SDAR.
"""

from __future__ import annotations

import torch

from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.block_diffusion import (
    BlockKVCache,
    generate_block_diffusion,
    generation_block,
    prefill_blocks,
)
from pdllm.shared.generation.policies import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.layout import DecodeLayout, Request
from pdllm.shared.model.transformer import DiffusionLM

_WHERE = "the pdllm engine on SDAR (block-diffusion) models"


def is_block_diffusion(model: DiffusionLM) -> bool:
    return model.config.block_size is not None


def check_config(config: EngineConfig, gen: GenerationConfig | None, model: DiffusionLM) -> None:
    """Refuse, before any compute, the settings the SDAR decode does not run (see the module docstring)."""
    if config.kv_mode == "chunk-only":
        raise ValueError(
            f"kv_mode='chunk-only' is not supported by {_WHERE}: the step-3 chunk KV is not block-causal "
            "at the decode positions (use kv_mode full-mask or chunk-query)"
        )
    if config.top_b is not None:
        raise ValueError(
            f"top_b={config.top_b} is not supported by {_WHERE}: dropped tokens leave holes in the "
            "positions that block diffusion aligns its blocks to (leave top_b unset)"
        )
    if gen is not None:
        gen.validate()
        generation_block(gen, model.config.block_size or 0)  # block_length: a multiple of the model block


def check_decode_options(decode_policy: DecodePolicyConfig | None, static_policy: object | None) -> None:
    if decode_policy is not None and decode_policy.name != "none":
        raise ValueError(f"decode policy {decode_policy.name!r} is not supported by {_WHERE}")
    if static_policy is not None:
        raise ValueError(f"a static-KV decode policy is not supported by {_WHERE}")


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
    device = next(model.parameters()).device
    seq = torch.tensor(selected_prompt(request, layout)[:end], dtype=torch.long, device=device)
    cache = BlockKVCache(prompt_len + gen.gen_length, model_block)
    prefill_blocks(model, cache, seq, end)
    return cache


def decode(
    model: DiffusionLM,
    request: Request,
    layout: DecodeLayout,
    prefix: BlockKVCache,
    gen: GenerationConfig,
    progress: bool = False,
) -> GenerationResult:
    """Step 7: block diffusion over the selected prompt, continuing ``prefix`` (filled further in place)."""
    device = next(model.parameters()).device
    prompt = torch.tensor(selected_prompt(request, layout), dtype=torch.long, device=device)
    return generate_block_diffusion(model, prompt, gen, progress=progress, prefix=prefix)
