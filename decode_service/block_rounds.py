"""Block diffusion (SDAR) in the batched rounds: each request's current block, one step per round.

A block-diffusion model attends causally across model blocks and bidirectionally inside one
(``shared/model/sdar.py``), so a finished block's K/V are an exact cache (``block_diffusion.py``; the
reference loop this module is tested against is ``tests/reference/block_diffusion.py``). Here the cache is the
request's pool pages, slot = position:

- the build (:func:`start_block_decode`) records the prompt's whole generation blocks (continuing a pdllm
  request's block-causal prefix) and the scheduler places them in the request's pages;
- each round, a :class:`BlockBatchSession` forwards its window (the cache's end to its current block's end:
  the prompt's last partial block rides with the first answer block), split at model-block boundaries into
  attention entries, each over the pool slots before it plus its own rows; an earlier model block of the
  window stores its K/V in the pool at the start of every layer, where the later ones read it;
- once a block has finished, the next round also forwards its final tokens ahead of the next window, and
  stores their K/V: the block's record, which the reference loop runs as a forward of its own, rides in the
  next block's first step.

Sampling stays on the host (``DenoiseState`` over the aligned spans): a round reads its predictions back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdllm.decode_service.block_diffusion import (
    BlockKVCache,
    answer_spans,
    check_prefix,
    generation_block,
    prefill_blocks,
)
from pdllm.decode_service.request import BlockDecode
from pdllm.decode_service.round_packing import RoundRows
from pdllm.decode_service.rounds import BatchSession
from pdllm.shared.decode_policy import FocusConfig
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV


def block_slots(prompt_tokens: int, gen: GenerationConfig) -> int:
    """Pool slots a block-diffusion request holds: one per position of prompt and answer."""
    return prompt_tokens + gen.gen_length


@torch.inference_mode()
def start_block_decode(
    model: DiffusionLM,
    prompt: torch.Tensor,
    gen: GenerationConfig,
    prefix: BlockKVCache | None = None,
    focus: FocusConfig | None = None,
) -> BlockDecode:
    """The build of a block-diffusion request over ``prompt`` (1-D, on the model's device): its whole
    generation blocks recorded block-causally, continuing ``prefix`` (which holds the first whole model
    blocks, filled further in place) when given; ``focus``: its steps under FOCUS."""
    model_block = model.config.block_size
    if model_block is None:
        raise ValueError(f"{model.config.family} is not a block-diffusion model (no block_size)")
    gen.validate()
    block = generation_block(gen, model_block)
    total = prompt.numel() + gen.gen_length
    cached_prompt = prompt.numel() // block * block  # the last partial block is decoded with the answer
    cache = BlockKVCache(total, model_block) if prefix is None else prefix
    check_prefix(cache, total, model_block, cached_prompt)
    start = time.perf_counter()
    prefill_blocks(model, cache, prompt, cached_prompt)
    static = StaticKV([cache.tensor()], query_start=0) if cache.length else None
    if prompt.device.type == "cuda":
        torch.cuda.synchronize(prompt.device)
    return BlockDecode(prompt.tolist(), static, gen, prefill_s=time.perf_counter() - start, focus=focus)


@dataclass
class BlockBatchSession(BatchSession):
    """One block-diffusion request in the rounds. Local rows are positions (``query``: the whole prompt,
    ``query_start`` 0); ``kv_tokens``: positions whose final K/V its pages hold or the next round stores."""

    model_block: int = 0
    page_size: int = 0
    prefill_s: float = 0.0

    @classmethod
    def begin(
        cls, model: DiffusionLM, made: BlockDecode, pages: list[int], page_size: int
    ) -> BlockBatchSession:
        model_block = model.config.block_size
        assert model_block is not None, "block diffusion needs a block-diffusion model"
        gen = made.gen
        spans = answer_spans(len(made.prompt), gen.gen_length, generation_block(gen, model_block))
        config = model.config
        state = DenoiseState(gen, config.mask_token_id, config.eos_token_id, "cpu", spans)
        kv = 0 if made.static is None else made.static.num_tokens
        return cls(
            list(made.prompt), 0, kv, list(pages), state, model_block=model_block, page_size=page_size,
            prefill_s=made.prefill_s,
        )  # fmt: skip

    def result(self) -> GenerationResult:
        out = super().result()
        out.timings = {**out.timings, "prefill": self.prefill_s}
        return out

    def round_parts(self) -> list[RoundRows]:
        """The finished block's record (if one is owed) and the current window, in model-block entries;
        the record counts as stored from here on (this round stores it)."""
        state, p = self.state, len(self.query)
        lo, hi = state.spans[state.block]
        window = p + lo if state.block else self.kv_tokens
        parts = self._entries(self.kv_tokens, window, store_last=True)
        parts += self._entries(window, p + hi, store_last=False)
        self.kv_tokens = window
        return parts

    def _entries(self, lo: int, hi: int, store_last: bool) -> list[RoundRows]:
        """Positions ``[lo, hi)`` as one entry per model block, each reading every slot before it; each
        stores its K/V, the last one only if ``store_last``."""
        out: list[RoundRows] = []
        a = lo
        while a < hi:
            b = min(hi, (a // self.model_block + 1) * self.model_block)
            stores = b < hi or store_last
            writes = tuple((r, self.pages[r // self.page_size], r % self.page_size) for r in range(a, b))
            out.append(RoundRows(a, b, a, writes if stores else ()))
            a = b
        return out
