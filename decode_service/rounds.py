"""Batched decode rounds: one denoising step of every active session in one model forward.

Each session keeps its own static KV (in the worker's :class:`~pdllm.decode_service.kv_pool.DecodeKVPool`
pages), its own query + response tokens at its own positions, its own block, step, schedule and seed.
A round packs all sessions' local tokens into one ragged row: the GEMMs see every session's rows at once
(a decode step is weight-bound, so many sessions cost little more than one), attention is one varlen
split-S call per layer over all sessions' page tables (:class:`PagedBatchAttention`), the LM head runs
only on the rows still masked in each session's current block, and :func:`predict_many` turns all those
logits into predictions with one copy to the host. The per-session unmasking (top-k / threshold on the
CPU-resident :class:`~pdllm.shared.generation.sampler.DenoiseState`) then costs no device sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.kernels.split_s_reference import split_s_attention_reference
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, predict_many
from pdllm.shared.model.transformer import DiffusionLM

ROUND_ATTENTIONS = ("torch", "triton")


@dataclass
class BatchSession:
    """One request in the rounds. ``query_start``: position of its first query token (static positions
    keep top-B holes, so it can exceed ``kv_tokens``); ``pages``: its pool pages, in order."""

    query: list[int]
    query_start: int
    kv_tokens: int
    pages: list[int]
    state: DenoiseState
    seconds: float = 0.0  # wall time of the rounds it took part in

    @classmethod
    def start(
        cls,
        model: DiffusionLM,
        query: list[int],
        query_start: int,
        kv_tokens: int,
        pages: list[int],
        gen: GenerationConfig,
    ) -> BatchSession:
        state = DenoiseState(gen, model.config.mask_token_id, model.config.eos_token_id, "cpu")
        return cls(list(query), query_start, kv_tokens, list(pages), state)

    @property
    def done(self) -> bool:
        return self.state.done

    def partial(self) -> list[int]:
        """Response slots so far, -1 where still masked."""
        return [-1 if t == self.state.mask_id else t for t in self.state.tokens.tolist()]

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=self.state.result(),
            raw_tokens=self.state.tokens.tolist(),
            steps=self.state.steps_taken,
            decode_seconds=self.seconds,
        )


class PagedBatchAttention:
    """Every session's queries attend to its own static KV (pool pages) and to its own local tokens.

    ``kernel``: "triton" (the split-S kernel, CUDA or the Triton interpreter) or "torch" (the kernel's
    pure-torch reference, for CPU). All sizes are fixed on the host, so no call reads the device.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        kv_lens: torch.Tensor,
        q_offsets: torch.Tensor,
        max_q_len: int,
        max_kv_len: int,
        kernel: str,
    ) -> None:
        if kernel not in ROUND_ATTENTIONS:
            raise ValueError(f"round attention must be one of {ROUND_ATTENTIONS}, got {kernel!r}")
        self.kv, self.page_table, self.kv_lens, self.q_offsets = kv, page_table, kv_lens, q_offsets
        self.max_q_len, self.max_kv_len, self.kernel = max_q_len, max_kv_len, kernel

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qt = q[0].transpose(0, 1)
        kl = k[0].transpose(0, 1).contiguous()
        vl = v[0].transpose(0, 1).contiguous()
        args = (qt, self.kv[layer, 0], self.kv[layer, 1], self.page_table, self.kv_lens, self.q_offsets)
        if self.kernel == "triton":
            from pdllm.kernels.split_s_attention import split_s_attention

            out = split_s_attention(
                *args, k_local=kl, v_local=vl, max_q_len=self.max_q_len, max_kv_len=self.max_kv_len
            )
        else:
            out = split_s_attention_reference(qt.contiguous(), *args[1:], k_local=kl, v_local=vl)
        return out.transpose(0, 1)[None]


@dataclass
class PackedRound:
    """Host-side packing of one round: ``ids``/``positions`` ``[T]``, ``rows`` (masked rows into the packed
    tokens, shifted logits applied later by the model), per-session row ``counts`` and attention metadata."""

    ids: list[int]
    positions: list[int]
    rows: list[int]
    counts: list[int]
    q_offsets: list[int]
    page_table: list[list[int]]
    kv_lens: list[int]

    @classmethod
    def pack(cls, sessions: list[BatchSession]) -> PackedRound:
        out = cls([], [], [], [], [0], [], [])
        for s in sessions:
            masked = s.state.positions()
            local = s.query + s.state.tokens.tolist()
            base = out.q_offsets[-1]
            out.ids += local
            out.positions += range(s.query_start, s.query_start + len(local))
            out.rows += (masked + base + len(s.query)).tolist()
            out.counts.append(int(masked.numel()))
            out.q_offsets.append(base + len(local))
            out.page_table.append(s.pages)
            out.kv_lens.append(s.kv_tokens)
        return out

    def table(self, sessions: int, width: int) -> torch.Tensor:
        """The page tables as one int32 ``[sessions, width]`` CPU tensor, zero-padded (padded rows and
        slots are never read: their sessions have no query rows, slots beyond ``kv_lens`` are masked)."""
        out = torch.zeros(sessions, width, dtype=torch.int32)
        for i, pages in enumerate(self.page_table):
            out[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return out

    @property
    def max_q_len(self) -> int:
        return max(hi - lo for lo, hi in zip(self.q_offsets, self.q_offsets[1:]))


class EagerRoundForward:
    """A round's forward run op by op: packed tokens in, logits of the packed ``rows`` out."""

    def __init__(self, model: DiffusionLM, pool: DecodeKVPool, kernel: str) -> None:
        self.model, self.pool, self.kernel = model, pool, kernel

    def __call__(self, packed: PackedRound) -> torch.Tensor:
        device = self.pool.kv.device
        b, t = len(packed.kv_lens), len(packed.ids)
        width = max(len(p) for p in packed.page_table)
        table = packed.table(b, width).flatten()
        ints = torch.cat([torch.tensor(packed.q_offsets + packed.kv_lens, dtype=torch.int32), table]).to(
            device
        )
        q_offsets, kv_lens, page_table = (
            ints[: b + 1],
            ints[b + 1 : 2 * b + 1],
            ints[2 * b + 1 :].view(b, width),
        )
        longs = torch.tensor([*packed.ids, *packed.positions, *packed.rows]).to(device)
        ids, positions, rows = longs[:t], longs[t : 2 * t], longs[2 * t :]
        attention = PagedBatchAttention(
            self.pool.kv, page_table, kv_lens, q_offsets, packed.max_q_len, max(packed.kv_lens), self.kernel
        )
        hidden = self.model.hidden_states(ids[None], positions[None], attention)
        return self.model.logits_from_hidden(hidden, rows[None])[0]


RoundForward = Callable[[PackedRound], torch.Tensor]


@torch.inference_mode()
def decode_round(forward: RoundForward, sessions: list[BatchSession]) -> list[torch.Tensor]:
    """One denoising step of every session in one ``forward``; returns each session's newly unmasked
    response positions (CPU). Finished sessions must not be passed."""
    if not sessions:
        return []
    start = time.perf_counter()
    packed = PackedRound.pack(sessions)
    logits = forward(packed)
    predictions = predict_many(logits, [s.state for s in sessions], packed.counts)
    picked = [s.state.apply(*p) for s, p in zip(sessions, predictions, strict=True)]
    elapsed = time.perf_counter() - start
    for s in sessions:
        s.seconds += elapsed
    return picked
