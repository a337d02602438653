"""Steps 5b-6, fast path: build the static decode KV of the selected chunks (+ top-B retention).

The decode worker runs it for every pdllm request before the request joins the batched rounds; the
in-process engine runs it in its decode phase too.

``full-mask``: one bidirectional forward over ``[instruction, chunks, query, MASK * gen_length]`` at the
continuous positions; the instruction + chunk part of its K/V is kept. ``chunk-query``: the same without
the masked response. ``chunk-only``: no forward over the chunks at all; the step-3 KV is reused with K
re-rotated from chunk-local to continuous positions (RoPE composes, so rotating by the start offset is
exact up to rounding), the instruction is encoded alone. Retention scores follow ``shared/reference.py``:
:class:`RetentionProbe` sums them during the build forward, ``chunk-only`` probes the first decode forward.
``retention="triton"`` sums them with :class:`KernelRetentionProbe` instead: same scores, from the flash
attention's LSE and ``kernels/retention_scores``; the decode worker picks it on CUDA for bidirectional
scores (``benchmarks/results/prefill_kernels.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from pdllm.decode_service.attention import SegmentedAttention
from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention
from pdllm.kernels.rope import rotate_half
from pdllm.shared.config import EngineConfig
from pdllm.shared.layout import DecodeLayout, Request, keep_top_b
from pdllm.shared.model.attention import AttentionBackend, DenseAttention, sdpa
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV
from pdllm.shared.stepwise import Steps, drain

RetentionImpl = Literal["torch", "triton"]


@dataclass
class _Capture:
    """Keeps the first ``n`` tokens' K/V of every layer in ``out[layer, 0|1]``."""

    inner: AttentionBackend
    out: torch.Tensor
    n: int

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.out[layer, 0] = k[0, :, : self.n]
        self.out[layer, 1] = v[0, :, : self.n]
        return self.inner(layer, q, k, v)


@dataclass
class RetentionProbe:
    """Bidirectional dense attention that also sums, per key position, the query<->key softmax mass.

    ``mass[j] += sum_h sum_{k in query} A[k, j] (+ A[j, k] when both directions)``, over layers and query
    heads; full-row softmax normalisation, computed ``block`` rows at a time so the full T x T matrix of a
    long build never exists at once.
    """

    query: slice
    both: bool
    block: int
    mass: torch.Tensor

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        kr = k[0].repeat_interleave(g, dim=0).float()
        scale = q.shape[-1] ** -0.5
        qf = q[0].float()
        rows = torch.softmax((qf[:, self.query] @ kr.transpose(1, 2)) * scale, dim=-1)
        self.mass += rows.sum(dim=(0, 1)).to(self.mass.dtype)
        if self.both:
            kq = kr[:, self.query]
            for a in range(0, q.shape[2], self.block):
                logits = (qf[:, a : a + self.block] @ kr.transpose(1, 2)) * scale
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                to_query = torch.exp((qf[:, a : a + self.block] @ kq.transpose(1, 2)) * scale - lse)
                self.mass[a : a + self.block] += to_query.sum(dim=(0, 2)).to(self.mass.dtype)
        return sdpa(q, k, v)


@dataclass
class KernelRetentionProbe:
    """:class:`RetentionProbe`'s scores without forming the attention matrix: one flash pass gives the output
    and each row's LSE, then ``retention_scores`` recomputes only the query x key and key x query tiles.

    The kernel takes the query as the suffix of its sequence. The build forward is bidirectional and
    unmasked, so the order of its rows is free (RoPE is already in q/k): the query rows are moved to the end
    (full-mask has the masked response after them). Only ``mass[:query.start]`` (instruction + chunks) is
    filled, the part :func:`_assemble` reads. Triton on CUDA (or under TRITON_INTERPRET=1).
    """

    query: slice
    both: bool
    mass: torch.Tensor
    # cu_seqlens, query_lens and the row order, made on the first layer (no host->device copy per layer).
    _consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = field(default=None, init=False)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from pdllm.kernels.retention_scores import retention_scores  # triton is optional on CPU installs

        t, start, stop = q.shape[2], self.query.start, self.query.stop
        if self._consts is None:
            order = None
            if stop != t:
                order = torch.cat([torch.arange(start), torch.arange(stop, t), torch.arange(start, stop)])
                order = order.to(q.device)
            cu = torch.tensor([0, t], dtype=torch.int32, device=q.device)
            self._consts = cu, torch.tensor([stop - start], dtype=torch.int32, device=q.device), order
        cu, ql, order = self._consts
        qp, kp, vp = (x[0].transpose(0, 1) for x in (q, k, v))  # [T, H, D] views
        out, lse = chunk_prefill_attention(qp, kp, vp, cu, return_lse=True, max_seqlen=t)
        if order is not None:
            qp, kp, lse = qp[order], kp[order], lse[order]
        # causal=True only drops the key -> query term; the LSE stays the bidirectional one.
        scores = retention_scores(
            qp, kp, cu, ql, lse=lse, causal=not self.both, max_chunk_len=t - stop + start
        )
        self.mass[:start] += scores[:start].to(self.mass.dtype)
        return out.transpose(0, 1)[None]


def rotate_keys(model: DiffusionLM, segment: torch.Tensor, delta: int) -> torch.Tensor:
    """Chunk KV with K moved ``delta`` positions further (pure rotation: RoPE's scaling is already in K)."""
    if delta == 0:
        return segment
    inv_freq = model.model.rotary_emb.inv_freq.float()
    angles = torch.cat([delta * inv_freq, delta * inv_freq])
    k = segment[:, 0].float()
    k = k * angles.cos() + rotate_half(k) * angles.sin()
    return torch.stack([k.to(segment.dtype), segment[:, 1]], dim=1)


def _empty(model: DiffusionLM, n: int) -> torch.Tensor:
    cfg = model.config
    p = next(model.parameters())
    return torch.empty(cfg.num_layers, 2, cfg.num_kv_heads, n, cfg.head_dim, dtype=p.dtype, device=p.device)


def build_static(
    model: DiffusionLM,
    request: Request,
    layout: DecodeLayout,
    config: EngineConfig,
    local_segments: Sequence[torch.Tensor] = (),
    retention: RetentionImpl = "torch",
) -> StaticKV:
    """``local_segments``: step-3 KV of the selected chunks (document order), needed by chunk-only only.
    ``retention``: how top-B scores are summed in the build forward (chunk-only always probes in torch)."""
    return drain(build_static_steps(model, request, layout, config, local_segments, retention))


@torch.inference_mode()
def build_static_steps(
    model: DiffusionLM,
    request: Request,
    layout: DecodeLayout,
    config: EngineConfig,
    local_segments: Sequence[torch.Tensor] = (),
    retention: RetentionImpl = "torch",
    layers_per_step: int | None = None,
) -> Steps[StaticKV]:
    """:func:`build_static` in pieces of ``layers_per_step`` layers of the build forward (chunk-only: one
    piece), for a scheduler that runs builds between decode rounds."""
    if config.kv_mode == "chunk-only":
        return _chunk_only(model, request, layout, config, local_segments)
    device = next(model.parameters()).device
    mask_id = model.config.mask_token_id
    ids = list(request.instruction)
    for i in layout.chunk_ids:
        ids += request.chunks[i]
    ids += request.query
    if config.kv_mode == "full-mask":
        ids += [mask_id] * layout.gen_length
    s, q = layout.static_len, layout.query_len
    static = _empty(model, s)
    mass = torch.zeros(len(ids), dtype=torch.float64, device=device)
    inner: AttentionBackend = DenseAttention()
    both = config.retention_score == "bidirectional"
    if config.top_b is not None and retention == "triton":
        inner = KernelRetentionProbe(slice(s, s + q), both, mass)
    elif config.top_b is not None:
        inner = RetentionProbe(slice(s, s + q), both, config.retention_block, mass)
    tokens = torch.tensor(ids, device=device)[None]
    positions = torch.arange(len(ids), device=device)[None]
    yield from model.hidden_states_steps(tokens, positions, _Capture(inner, static, s), layers_per_step)
    return _assemble(layout, config, static, mass)


def _assemble(
    layout: DecodeLayout, config: EngineConfig, static: torch.Tensor, mass: torch.Tensor
) -> StaticKV:
    segments = [static[:, :, :, : layout.instruction_len]] if layout.instruction_len else []
    kept_counts = []
    for a, n in zip(layout.chunk_starts, layout.chunk_lens, strict=True):
        if config.top_b is None or config.top_b >= n:
            segments.append(static[:, :, :, a : a + n])
            kept_counts.append(n)
            continue
        keep = keep_top_b(mass[a : a + n], config.top_b)
        segments.append(static[:, :, :, a + keep])
        kept_counts.append(int(keep.numel()))
    contiguous = static if sum(kept_counts) == sum(layout.chunk_lens) else None
    return StaticKV(segments, layout.static_len, contiguous, kept_counts)


def _chunk_only(
    model: DiffusionLM,
    request: Request,
    layout: DecodeLayout,
    config: EngineConfig,
    local_segments: Sequence[torch.Tensor],
) -> StaticKV:
    if len(local_segments) != len(layout.chunk_ids):
        raise ValueError("chunk-only KV build needs the step-3 KV of every selected chunk")
    device = next(model.parameters()).device
    parts = []
    if layout.instruction_len:
        instr = _empty(model, layout.instruction_len)
        tokens = torch.tensor(request.instruction, device=device)[None]
        model.hidden_states(tokens, attention=_Capture(DenseAttention(), instr, layout.instruction_len))
        parts.append(instr)
    for seg, a in zip(local_segments, layout.chunk_starts, strict=True):
        parts.append(rotate_keys(model, seg, a))
    static = torch.cat(parts, dim=3)
    mass = torch.zeros(layout.static_len, dtype=torch.float64, device=device)
    if config.top_b is not None:
        _probe_first_step(model, request, layout, static, mass)
    return _assemble(layout, config, static, mass)


@dataclass
class _QueryToStatic:
    """First decode forward (all-masked response): accumulates the query rows' softmax mass on static keys."""

    static: torch.Tensor
    query_len: int
    mass: torch.Tensor

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        keys = torch.cat([self.static[layer, 0][None], k], dim=2)[0].repeat_interleave(g, dim=0).float()
        logits = (q[0, :, : self.query_len].float() @ keys.transpose(1, 2)) * q.shape[-1] ** -0.5
        probs = torch.softmax(logits, dim=-1)[:, :, : self.static.shape[3]]
        self.mass += probs.sum(dim=(0, 1)).to(self.mass.dtype)
        return SegmentedAttention([self.static])(layer, q, k, v)


def _probe_first_step(
    model: DiffusionLM, request: Request, layout: DecodeLayout, static: torch.Tensor, mass: torch.Tensor
) -> None:
    device = static.device
    ids = request.query + [model.config.mask_token_id] * layout.gen_length
    tokens = torch.tensor(ids, device=device)[None]
    positions = layout.local_positions(device)[None]
    model.hidden_states(tokens, positions, _QueryToStatic(static, layout.query_len, mass))
