"""Step 3, fast path: batched chunk prefill into a :class:`ChunkBank`, with content-keyed reuse.

Both workers run it: the prefill worker on every chunk (the KV that scoring reads; which of it goes to the
chunk store is decided after selection, ``shared/kv_write_policy.py``), the decode worker in chunk-only mode
on the selected chunks (their stored KV, or a recompute when the store misses). :class:`WriteKV` copies each
layer's chunk K/V into the bank during the forward. Chunks are forwarded ``prefill_batch`` at a time,
right-padded to the longest one; each chunk sits at its own positions 0..T-1 with intra-chunk attention
only. Under causal attention the padding is invisible to real tokens; under bidirectional attention a key
mask hides it. Chunks found in the store are copied in and never forwarded, so a second question on a
document whose chunks are all stored skips step 3 entirely.

``kernel`` picks the attention of those forwards: "sdpa" (the default: padded SDPA, masked when
bidirectional) or "varlen" (:class:`~pdllm.shared.model.attention.VarlenAttention`: the packed chunks
through ``kernels/chunk_prefill_attention``, no padding, no mask); same KV. The decode worker uses
"varlen" for bidirectional chunks on CUDA; ``benchmarks/results/prefill_kernels.md`` has both timed.

With ``hand_over``, :func:`chunk_prefill_steps` yields each forward as a :class:`ChunkForward` instead of
running it: its driver runs it alone, or (the all-in-one decode scheduler) packs its chunk rows into a decode
round's forward, so the round's rows ride on the piece's weight reads (``decode_service/prefill_rows.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from pdllm.shared.chunk_store import ChunkKVStore, chunk_keys
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.kv_tier.staging import load_into
from pdllm.shared.model.attention import AttentionBackend, DenseAttention, VarlenAttention
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.stepwise import Steps, drain

ChunkAttentionKernel = Literal["sdpa", "varlen"]
CHUNK_ATTENTION_KERNELS = ("sdpa", "varlen")


class PrefillStopped(Exception):
    """A chunk prefill abandoned between forwards because nobody waits for it any more."""


@dataclass
class ChunkBank:
    """Step-3 KV of N chunks, padded: ``kv[layer, 0|1, chunk, head, token, dim]``; ``lens[chunk]`` tokens."""

    kv: torch.Tensor
    lens: list[int]

    def segment(self, i: int) -> torch.Tensor:
        """Chunk ``i`` in the chunk-KV layout ``[layers, 2, Hkv, T, D]`` (a view)."""
        return self.kv[:, :, i, :, : self.lens[i]]

    def take(self, rows: list[int]) -> ChunkBank:
        """A bank of ``rows`` in that order: a view when they are a run, else a copy."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return ChunkBank(self.kv[:, :, rows[0] : rows[0] + len(rows)], [self.lens[i] for i in rows])
        index = torch.tensor(rows, dtype=torch.long, device=self.kv.device)
        return ChunkBank(self.kv.index_select(2, index), [self.lens[i] for i in rows])


@dataclass
class WriteKV:
    inner: AttentionBackend
    bank: ChunkBank
    rows: slice

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = k.shape[2]
        self.bank.kv[layer, 0, self.rows, :, :t] = k
        self.bank.kv[layer, 1, self.rows, :, :t] = v
        return self.inner(layer, q, k, v)


@dataclass
class ChunkForward:
    """One batched chunk-prefill forward: chunks ``group`` (indices into ``chunks``, at positions 0..T-1
    each, intra-chunk attention) whose K/V of every layer go to those rows of ``bank``."""

    model: DiffusionLM
    chunks: Sequence[Sequence[int]]
    group: list[int]
    bank: ChunkBank
    attention: str
    kernel: ChunkAttentionKernel
    error: BaseException | None = None  # set by a driver whose forward carrying it failed

    @property
    def causal(self) -> bool:
        return self.attention == "causal"

    @property
    def tokens(self) -> int:
        return sum(self.bank.lens[i] for i in self.group)

    def run(self) -> None:
        """The forward on its own (padded batch, :func:`encode_kv`)."""
        device = self.bank.kv.device
        _forward_group(self.model, self.chunks, self.group, self.bank, self.attention, device, self.kernel)


@dataclass
class PrefillStats:
    chunks: int = 0
    forwarded: int = 0
    hit_rows: list[int] = field(default_factory=list)  # chunks whose KV came from the store

    @property
    def hits(self) -> int:
        return len(self.hit_rows)


def empty_bank(model: DiffusionLM, lens: Sequence[int], tail: int = 0) -> ChunkBank:
    """A zeroed bank for chunks of ``lens`` tokens; ``tail`` free slots after the longest (scoring writes
    its query tokens' K/V there and attends over the row in place, instead of concatenating a copy)."""
    cfg = model.config
    p = next(model.parameters())
    shape = (cfg.num_layers, 2, len(lens), cfg.num_kv_heads, max(lens) + tail, cfg.head_dim)
    return ChunkBank(kv=torch.zeros(shape, dtype=p.dtype, device=p.device), lens=list(lens))


def chunk_prefill(
    model: DiffusionLM,
    chunks: Sequence[Sequence[int]],
    attention: str,
    chunk_size: int,
    batch: int,
    store: ChunkKVStore | None = None,
    keys: Sequence[str] | None = None,
    kernel: ChunkAttentionKernel = "sdpa",
) -> tuple[ChunkBank, PrefillStats]:
    """KV of every chunk (BOS included) at chunk-local positions; ``attention`` is "causal"/"bidirectional".

    ``keys``: the chunks' store keys when the caller has them already (else computed here, with a store)."""
    return drain(chunk_prefill_steps(model, chunks, attention, chunk_size, batch, store, keys, kernel=kernel))


@torch.inference_mode()
def chunk_prefill_steps(
    model: DiffusionLM,
    chunks: Sequence[Sequence[int]],
    attention: str,
    chunk_size: int,
    batch: int,
    store: ChunkKVStore | None = None,
    keys: Sequence[str] | None = None,
    max_tokens: int | None = None,
    kernel: ChunkAttentionKernel = "sdpa",
    stop: Callable[[], bool] | None = None,
    publish: bool = True,
    tail: int = 0,
    hand_over: bool = False,
) -> Steps[tuple[ChunkBank, PrefillStats]]:
    """:func:`chunk_prefill` in pieces: yields after each batched forward, which holds at most ``batch``
    chunks and, with ``max_tokens``, at most that many padded tokens (always at least one chunk).
    ``stop`` is asked before every forward; True raises :class:`PrefillStopped` (nothing is stored).
    ``publish``: write the computed chunks' KV to ``store`` at the end; False leaves the writes to the
    caller (the prefill worker writes after selection, by its write policy; the store is then only read).
    ``tail``: free slots after each bank row (:func:`empty_bank`). ``hand_over``: yield each forward as a
    :class:`ChunkForward` for the driver to run, instead of running it and yielding None after it."""
    if kernel not in CHUNK_ATTENTION_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(CHUNK_ATTENTION_KERNELS)}; got {kernel!r}")
    bank = empty_bank(model, [len(c) for c in chunks], tail)
    stats = PrefillStats(chunks=len(chunks))
    todo = list(range(len(chunks)))
    if store is not None:
        if keys is None:
            keys = chunk_keys(model.config.model_id, bank.kv.dtype, chunk_size, attention, chunks)
        found = store.get_many(keys)
        todo = []
        hits = []
        for i, value in enumerate(found):
            expected = (bank.kv.shape[0], 2, bank.kv.shape[3], bank.lens[i], bank.kv.shape[5])
            if value is None or tuple(value.shape) != expected:
                todo.append(i)
                continue
            hits.append((bank.kv[:, :, i, :, : bank.lens[i]], value))
            stats.hit_rows.append(i)
        # Straight into the bank, asynchronously: the CPU tier holds pageable memory, which goes to the
        # device through a small reused ring of pinned buffers; a hit costs no device sync.
        load_into(hits)
    # Longest first, so equal-length chunks batch together (fixed boundaries: only the last is shorter).
    todo.sort(key=lambda i: -bank.lens[i])
    a = 0
    while a < len(todo):
        size = batch if max_tokens is None else max(1, min(batch, max_tokens // bank.lens[todo[a]]))
        group = todo[a : a + size]
        if stop is not None and stop():
            raise PrefillStopped(f"stopped after {stats.forwarded} of {len(todo)} chunk forwards")
        work = ChunkForward(model, chunks, group, bank, attention, kernel)
        if hand_over:
            yield work  # run by the driver before it resumes us
        else:
            work.run()
        stats.forwarded += len(group)
        a += size
        if not hand_over and a < len(todo):
            yield
    if publish and store is not None and keys is not None and todo:
        store.put_many([(keys[i], bank.segment(i).contiguous()) for i in sorted(todo)])
    return bank, stats


def _skip(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q


def encode_kv(
    model: DiffusionLM,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    inner: AttentionBackend,
    bank: ChunkBank,
    rows: slice,
) -> None:
    """The model's forward up to the last layer's K/V: that layer's attention and MLP, the final norm and
    the LM head feed nothing the bank needs (about 1/num_layers of the prefill FLOPs saved)."""
    body = model.model
    x = body.embed_tokens(tokens)
    cos, sin = body.rotary_emb(positions, x.dtype)
    write = WriteKV(inner, bank, rows)
    for layer in body.layers[:-1]:
        x = layer(x, cos, sin, write)
    last = body.layers[-1]
    last.self_attn(last.input_layernorm(x), cos, sin, WriteKV(_skip, bank, rows))


def _forward_group(
    model: DiffusionLM,
    chunks: Sequence[Sequence[int]],
    group: list[int],
    bank: ChunkBank,
    attention: str,
    device: torch.device,
    kernel: ChunkAttentionKernel,
) -> None:
    width = max(bank.lens[i] for i in group)
    pad = model.config.mask_token_id
    # one pinned copy of the padded tokens: per-chunk pageable copies would each wait for queued kernels
    tokens = to_device([[*chunks[i], *[pad] * (width - bank.lens[i])] for i in group], torch.long, device)
    lens = to_device([bank.lens[i] for i in group], torch.long, device)
    valid = torch.arange(width, device=device)[None] < lens[:, None]
    inner: AttentionBackend
    if kernel == "varlen":
        inner = VarlenAttention([bank.lens[i] for i in group], width, attention == "causal", device)
    elif attention == "causal":
        inner = DenseAttention(causal=True)
    else:
        inner = DenseAttention(mask=valid[:, None, None, :].expand(-1, 1, width, -1))
    positions = torch.arange(width, device=device).expand(len(group), -1)
    # Rows of the bank are the chunk indices; a contiguous slice when the group is a run, else staged.
    if group == list(range(group[0], group[0] + len(group))):
        encode_kv(model, tokens, positions, inner, bank, slice(group[0], group[0] + len(group)))
        return
    staging = empty_bank(model, [bank.lens[i] for i in group])
    encode_kv(model, tokens, positions, inner, staging, slice(0, len(group)))
    for row, i in enumerate(group):
        bank.kv[:, :, i, :, : bank.lens[i]] = staging.segment(row)
