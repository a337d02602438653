"""Block-by-block decoding for block-diffusion models (SDAR): the plain generation path for that family.

A block-diffusion model attends causally across blocks of ``model.config.block_size`` positions (aligned to
absolute position 0) and bidirectionally inside a block (``model/sdar.py``). So a finished block's K/V
never change, and decoding keeps them as an exact cache, like an autoregressive model does:

1. The prompt's whole generation blocks are prefilled block-causally (in pieces of whole blocks) and
   their K/V recorded. The prompt's last partial block is *not* cached: it is decoded together with the
   first answer tokens (its prompt tokens stay fixed), as SDAR itself aligns blocks.
2. Each generation block (``config.block_length``, a multiple of the model's block size; blocks aligned to
   absolute multiples of it, so the first and last answer blocks may be shorter) is denoised with the
   shared sampler (:class:`~.sampler.DenoiseState`: schedule or threshold, EOS stop), every step one
   forward over the block alone against the cache of all earlier blocks.
3. A finished block gets one more forward, over its final tokens, to record its K/V: the last
   denoising step computed K/V from a block that still held masks, so those are not the block's K/V.

Memory: the cache is preallocated for prompt + answer per layer (no re-concatenation per block).

:class:`BlockDiffusionSession` is one request's steps 1-3, advanced one denoising step at a time:
:func:`generate_block_diffusion` drives one to the end (:func:`run_to_end`, which also drives a decode
policy's session, e.g. FOCUS's ``policies/focus_reference.FocusBlockSession``). It is the reference loop:
the decode worker and the engine run block diffusion in the batched rounds (``block_rounds.py``).

``step`` (optional, :data:`BlockStep`) replaces step 2's forward + sampler update with the caller's own
(a decode policy's: FOCUS forwards only some rows of the block); prefill, recording and stopping stay here.

``prefix`` (optional): a cache that already holds the K/V of the prompt's first whole model blocks, e.g. the
pdllm engine's block-causal static KV of ``[instruction, selected chunks]`` (``sdar_decode.py``).
Step 1 then records only the rest of the prompt's whole generation blocks; nothing else changes, so the
result equals a run without it whenever the prefix holds exactly what step 1 would have recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.attention import RecordKV
from pdllm.shared.model.sdar import BlockCausalAttention
from pdllm.shared.model.transformer import DiffusionLM

# Prompt tokens per prefill forward (rounded down to whole generation blocks): bounds the [T, T] mask and
# the activations of a long prompt without changing any value (the pieces are exact, like the blocks).
PREFILL_PIECE_TOKENS = 2048

BlockStep = Callable[["DenoiseState", torch.Tensor, torch.Tensor, torch.Tensor, "BlockKVCache"], None]
"""One denoising step of the current block, applied to the state by the callee: ``(state, window tokens [T],
window positions [T], the masked slots as window indices [n], cache of the earlier blocks)``."""


def generation_block(config: GenerationConfig, model_block: int) -> int:
    """The generation block length, checked against the model's block size (a multiple of it, or equal).

    A generation block must hold whole model blocks: its boundary is where K/V get cached, and a model
    block split across two generation blocks would have its first part cached before it saw its second.
    """
    block = config.block
    if block % model_block:
        named = "block_length" if config.block_length is not None else "block_length (unset: gen_length)"
        raise ValueError(
            f"{named} is {block}, but this SDAR (block-diffusion) model has block size {model_block}: the "
            f"generation block length must be a multiple of {model_block} (e.g. --block-length {model_block})"
        )
    return block


def answer_spans(prompt_length: int, gen_length: int, block: int) -> list[tuple[int, int]]:
    """The answer's generation blocks as response-relative ``[lo, hi)``, aligned to absolute multiples of
    ``block``: the first one finishes the prompt's last partial block, the last one stops at the answer's
    end (no padding masks past ``gen_length``)."""
    spans: list[tuple[int, int]] = []
    lo = 0
    while lo < gen_length:
        hi = min(gen_length, ((prompt_length + lo) // block + 1) * block - prompt_length)
        spans.append((lo, hi))
        lo = hi
    return spans


class BlockKVCache:
    """The exact K/V of positions ``[0, length)`` per layer, in buffers sized for the whole sequence."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.length = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def attention(self, positions: torch.Tensor) -> BlockCausalAttention:
        """Block-causal attention for a forward at ``positions`` (all >= ``length``) over the cache."""
        if self.length == 0:
            return BlockCausalAttention(positions, self.block_size)
        n = self.length
        prefix = [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self._keys, self._values, strict=True)]
        return BlockCausalAttention(
            positions, self.block_size, prefix, torch.arange(n, device=positions.device)
        )

    def tensor(self) -> torch.Tensor:
        """The cached K/V as one ``[layers, 2, Hkv, length, D]`` tensor (batch row 0; the chunk-KV layout)."""
        n = self.length
        keys = torch.stack([k[0, :, :n] for k in self._keys])
        values = torch.stack([v[0, :, :n] for v in self._values])
        return torch.stack([keys, values], dim=1)

    def append(self, record: RecordKV) -> None:
        """Add a forward's recorded K/V (its tokens must be the next positions, ``length`` onwards)."""
        t = record.keys[0].shape[2]
        if self.length + t > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions cannot take {t} more after {self.length}")
        if not self._keys:
            for k in record.keys:
                b, h, _, d = k.shape
                self._keys.append(k.new_empty((b, h, self.capacity, d)))
                self._values.append(k.new_empty((b, h, self.capacity, d)))
        n = self.length
        for buf, k in zip(self._keys, record.keys, strict=True):
            buf[:, :, n : n + t] = k
        for buf, v in zip(self._values, record.values, strict=True):
            buf[:, :, n : n + t] = v
        self.length += t


def prefill_blocks(
    model: DiffusionLM, cache: BlockKVCache, seq: torch.Tensor, hi: int, piece: int = PREFILL_PIECE_TOKENS
) -> None:
    """Record ``seq[cache.length:hi]`` (whole blocks) in forwards of about ``piece`` tokens (exact: each
    piece sees the cache of all earlier ones, the block-causal mask decides the rest)."""
    step = max(cache.block_size, piece // cache.block_size * cache.block_size)
    for lo in range(cache.length, hi, step):
        record_span(model, cache, seq, lo, min(hi, lo + step))


def record_span(model: DiffusionLM, cache: BlockKVCache, seq: torch.Tensor, lo: int, hi: int) -> None:
    """One forward over ``seq[lo:hi]`` (whole blocks, final tokens) that appends its K/V to the cache."""
    if lo != cache.length:
        raise ValueError(f"recording [{lo}, {hi}) but the cache ends at {cache.length}")
    positions = torch.arange(lo, hi, device=seq.device)
    record = RecordKV(cache.attention(positions))
    model.hidden_states(seq[lo:hi][None], positions[None], attention=record)  # no LM head: K/V only
    cache.append(record)


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


def check_prefix(cache: BlockKVCache, total: int, model_block: int, cached_prompt: int) -> None:
    """A ValueError unless ``cache`` can start a block diffusion of ``total`` positions whose prompt's whole
    generation blocks end at ``cached_prompt``."""
    # A prefix past the prompt's whole generation blocks would hold K/V of tokens that must still see the
    # answer's first block; one ending mid model block would hold K/V that never saw the rest of its block.
    if cache.capacity < total or cache.block_size != model_block:
        raise ValueError(
            f"prefix cache (capacity {cache.capacity}, block {cache.block_size}) cannot hold {total} "
            f"positions of block size {model_block}"
        )
    if cache.length > cached_prompt or cache.length % model_block:
        raise ValueError(
            f"prefix cache holds {cache.length} positions: it must end on a model block boundary "
            f"({model_block}) at or before the prompt's last whole generation block ({cached_prompt})"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
