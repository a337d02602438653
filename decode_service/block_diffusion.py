"""Block-by-block decoding for block-diffusion models (SDAR): the method, and the exact cache it keeps.

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

This module holds the pieces: the generation blocks (:func:`generation_block`, :func:`answer_spans`), the
cache (:class:`BlockKVCache`) and its recording (:func:`prefill_blocks`, :func:`record_span`). The decode
worker and the engine run steps 1-3 in the batched rounds (``block_rounds.py``, the cache in pool pages);
the one-request reference loop they are tested against is ``tests/reference/block_diffusion.py``.

A *prefix*: a cache that already holds the K/V of the prompt's first whole model blocks, e.g. the pdllm
engine's block-causal static KV of ``[instruction, selected chunks]`` (``sdar_decode.py``). Step 1 then
records only the rest of the prompt's whole generation blocks; nothing else changes, so the result equals a
run without it whenever the prefix holds exactly what step 1 would have recorded (:func:`check_prefix`).
"""

from __future__ import annotations

import torch

from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import RecordKV
from pdllm.shared.model.sdar import BlockCausalAttention
from pdllm.shared.model.transformer import DiffusionLM

# Prompt tokens per prefill forward (rounded down to whole generation blocks): bounds the [T, T] mask and
# the activations of a long prompt without changing any value (the pieces are exact, like the blocks).
PREFILL_PIECE_TOKENS = 2048


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
