"""Block diffusion (SDAR), one request (the reference loop): ``decode_service/block_diffusion.py``'s steps
1-3 advanced one denoising step at a time by a :class:`BlockDiffusionSession`; :func:`generate_block_diffusion`
drives one to the end (:func:`run_to_end`, which also drives a decode policy's session, e.g. FOCUS's
``focus.FocusBlockSession``). The decode worker and the engine run block diffusion in the batched rounds
(``decode_service/block_rounds.py``, ``sdar_focus_rounds.py``), held to this loop token for token.

``step`` (optional, :data:`BlockStep`) replaces step 2's forward + sampler update with the caller's own
(a decode policy's: FOCUS forwards only some rows of the block); prefill, recording and stopping stay here.

``prefix`` (optional): a cache that already holds the K/V of the prompt's first whole model blocks (pdllm's
block-causal static KV, ``decode_service/sdar_decode.build_prefix``); it is filled further in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from pdllm.decode_service.block_diffusion import (
    PREFILL_PIECE_TOKENS,
    BlockKVCache,
    answer_spans,
    check_prefix,
    generation_block,
    prefill_blocks,
    record_span,
)
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM

BlockStep = Callable[["DenoiseState", torch.Tensor, torch.Tensor, torch.Tensor, "BlockKVCache"], None]
"""One denoising step of the current block, applied to the state by the callee: ``(state, window tokens [T],
window positions [T], the masked slots as window indices [n], cache of the earlier blocks)``."""


class BlockDiffusionSession:
    """One request's block diffusion, advanced one denoising step at a time (:meth:`step`).

    Construction is the prompt's prefill (step 1); each :meth:`step` is one denoising step of the current
    block (step 2), and the forward that records the block's K/V once it finished (step 3).
    :func:`generate_block_diffusion` drives one to the end. Same
    arguments as :func:`generate_block_diffusion`; ``state``, :meth:`partial`, ``done`` and :meth:`result`
    as a :class:`~.sampler.DenoiseSession`'s.
    """

    def __init__(
        self,
        model: DiffusionLM,
        prompt: torch.Tensor,
        config: GenerationConfig,
        prefill_piece: int = PREFILL_PIECE_TOKENS,
        step: BlockStep | None = None,
        prefix: BlockKVCache | None = None,
    ) -> None:
        with torch.inference_mode():
            self._start(model, prompt, config, prefill_piece, step, prefix)

    def _start(
        self,
        model: DiffusionLM,
        prompt: torch.Tensor,
        config: GenerationConfig,
        prefill_piece: int,
        step: BlockStep | None,
        prefix: BlockKVCache | None,
    ) -> None:
        model_block = model.config.block_size
        if model_block is None:
            raise ValueError(f"{model.config.family} is not a block-diffusion model (no block_size)")
        config.validate()
        block = generation_block(config, model_block)
        self.model, self.device, self.block_step = model, prompt.device, step
        self.prompt_length = p = prompt.numel()
        self.spans = answer_spans(p, config.gen_length, block)
        self.state = DenoiseState(
            config, model.config.mask_token_id, model.config.eos_token_id, self.device, self.spans
        )
        self.seq = torch.cat([prompt, self.state.tokens])
        cached_prompt = p // block * block  # the last partial block is decoded with the answer
        self.cache = BlockKVCache(self.seq.numel(), model_block) if prefix is None else prefix
        check_prefix(self.cache, self.seq.numel(), model_block, cached_prompt)
        start = time.perf_counter()
        prefill_blocks(model, self.cache, self.seq, cached_prompt, max(block, prefill_piece // block * block))
        _sync(self.device)
        self.prefill_seconds = time.perf_counter() - start
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return self.state.done

    @torch.inference_mode()
    def step(self) -> None:
        """One denoising step of the current block; records the block once it is finished."""
        start = time.perf_counter()
        state, cache, seq, p = self.state, self.cache, self.seq, self.prompt_length
        b = state.block
        lo, hi = cache.length, p + self.spans[b][1]
        seq[p:hi] = state.tokens[: hi - p]
        positions = torch.arange(lo, hi, device=self.device)
        rows = state.positions() + (p - lo)  # the block's masked slots, as indices into the window
        if self.block_step is not None:
            self.block_step(state, seq[lo:hi], positions, rows, cache)
        else:
            window, attention = seq[lo:hi][None], cache.attention(positions)
            logits = self.model(window, positions[None], attention=attention, logits_at=rows[None])[0]
            state.update(logits)
        if state.block != b and not state.done:  # finished, and a later block will attend to it
            seq[p:hi] = state.tokens[: hi - p]
            record_span(self.model, cache, seq, lo, hi)
        self.seconds += time.perf_counter() - start

    def partial(self) -> list[int]:
        """Response slots so far, -1 where still masked."""
        return [-1 if t == self.state.mask_id else t for t in self.state.tokens.tolist()]

    def result(self) -> GenerationResult:
        _sync(self.device)
        return GenerationResult(
            token_ids=self.state.result(),
            raw_tokens=self.state.tokens.tolist(),
            steps=self.state.steps_taken,
            decode_seconds=self.seconds,
            timings={"prefill": self.prefill_seconds},
        )


@torch.inference_mode()
def generate_block_diffusion(
    model: DiffusionLM,
    prompt: torch.Tensor,
    config: GenerationConfig,
    progress: bool = False,
    prefill_piece: int = PREFILL_PIECE_TOKENS,
    step: BlockStep | None = None,
    prefix: BlockKVCache | None = None,
) -> GenerationResult:
    """Generate ``config.gen_length`` tokens after ``prompt`` (1-D, on the model's device) block by block
    over the exact cache of earlier blocks (a :class:`BlockDiffusionSession` to the end).
    ``timings['prefill']``: seconds to cache the prompt. ``step``: a decode policy's denoising step instead
    of the plain one (None: a forward over the window). ``prefix``: the K/V of ``prompt[:prefix.length]``
    already recorded (see the module docstring); it is filled further in place, so its capacity must hold
    ``prompt`` + answer."""
    session = BlockDiffusionSession(model, prompt, config, prefill_piece, step, prefix)
    return run_to_end(session, config, progress)


@torch.inference_mode()
def run_to_end(
    session: BlockDiffusionSession, config: GenerationConfig, progress: bool = False
) -> GenerationResult:
    """Step ``session`` (built with ``config``) until it is done: its result, ``decode_seconds`` the wall time
    of the steps. Every in-process block diffusion ends here (plain, a decode policy's, pdllm's)."""
    start = time.perf_counter()
    total = config.gen_length if config.threshold is not None else min(config.steps, config.gen_length)
    with tqdm(total=total, disable=not progress, delay=1.0, desc="denoise", unit="step", leave=False) as bar:
        while not session.done:
            session.step()
            bar.update(1)
    result = session.result()
    result.decode_seconds = time.perf_counter() - start  # wall time, the final device sync included
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
