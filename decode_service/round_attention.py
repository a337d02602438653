"""The rounds' attention: every entry's queries over its own pool pages and its own fresh rows.

:class:`PagedBatchAttention` is the backend a round's forward passes to every layer: it stores the K/V a
round writes into the pool (``writes``, then the per-layer ``stores``), then runs one split-S call over all
entries (the Triton kernel, or :func:`gathered_attention` off the GPU). Where a policy's edit asks for it
(``wants_lse``), the call also keeps each row's log-sum-exp in :attr:`PagedBatchAttention.lse`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pdllm.kernels.split_s_reference import gather_request
from pdllm.shared.model.attention import sdpa

if TYPE_CHECKING:
    from pdllm.decode_service.layer_edits import LayerEdits
    from pdllm.decode_service.prefill_rows import PrefillRows

ROUND_ATTENTIONS = ("torch", "triton")

LayerStore = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor, "PagedBatchAttention"], None]
"""``(layer, first packed row, q [1, Hq, T, D], k [T, Hkv, D], v [T, Hkv, D], the round's attention)``,
called before the layer's attention; it may store into ``attention.kv`` (the pool's K/V) and attend with
``attention.paged``. A store with an ``attach(model)`` context manager has it entered around the forward;
one with a ``layer_inputs`` dict gets each layer's input ``[1, T, H]`` there, under the layer's index, before
the layer runs (Polestar-Cache's refresh)."""


def group_stores(stores: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``stores`` (first packed row, store) with those that share a ``group_key`` replaced by one store,
    their type's ``grouped`` of them (in the first one's place): one call per layer for all of them.
    Grouped stores touch only their own sessions' rows and slots, so their order does not matter."""
    groups: dict[Any, list[tuple[int, Any]]] = {}
    out: list[tuple[int, Any]] = []
    for base, store in stores:
        key = getattr(store, "group_key", None)
        if key is None:
            out.append((base, store))
        elif key in groups:
            groups[key].append((base, store))
        else:
            groups[key] = [(base, store)]
            out.append((base, groups[key]))
    return [(b, type(s[0][1]).grouped(s) if isinstance(s, list) else s) for b, s in out]


class PagedBatchAttention:
    """Every session's queries attend to its own static KV (pool pages) and to its own local tokens.

    ``kernel``: "triton" (the split-S kernel, CUDA or the Triton interpreter) or "torch" (gathered KV and
    SDPA per session, :func:`gathered_attention`, for CPU). All sizes are fixed on the host, so no call reads the device.

    ``writes`` (optional, three long tensors ``[W]``: packed row, pool page, slot in page): rows whose
    fresh K/V each layer also stores in the pool, where later rounds read them as paged KV (a decode
    policy's cache of local rows). Each layer stores before it attends, so an entry may read slots another
    entry of the same round stores (block diffusion: a finished block's record, earlier model blocks).

    ``lse``: after a layer call, each packed row's natural-log log-sum-exp ``[T, Hq]`` float32 of the
    scores it was normalized over (its static KV pages, then its entry's local rows as the edits left
    them), when some edit ``wants_lse``; else None (and not computed).
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
        writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        stores: list[tuple[int, LayerStore]] | None = None,
        drop: torch.Tensor | None = None,
    ) -> None:
        if kernel not in ROUND_ATTENTIONS:
            raise ValueError(f"round attention must be one of {ROUND_ATTENTIONS}, got {kernel!r}")
        self.kv, self.page_table, self.kv_lens, self.q_offsets = kv, page_table, kv_lens, q_offsets
        self.max_q_len, self.max_kv_len, self.kernel = max_q_len, max_kv_len, kernel
        self.writes, self.stores, self.drop = writes, stores or [], drop  # drop: [layers, sessions]
        self.edits: list[LayerEdits] = []  # a policy's edits of some parts' layers (``layer_edits.py``)
        # A chunk-prefill forward's rows after the round's (``prefill_rows.py``): attended on their own.
        self.prefill: PrefillRows | None = None
        self.lse: torch.Tensor | None = None

    @property
    def edit_ffn(self) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """The decoder layer's hook for the FFN output ``[1, T, H]`` (None: no part edits it)."""
        if not self.edits:
            return None

        def edit(layer: int, ffn: torch.Tensor) -> torch.Tensor:
            for e in self.edits:
                ffn = e.ffn(layer, ffn)
            return ffn

        return edit

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qt = q[0].transpose(0, 1)
        kl = k[0].transpose(0, 1)  # strided views: the kernel takes row strides, no copy
        vl = v[0].transpose(0, 1)
        piece = None
        if self.prefill is not None:
            s = self.prefill.start
            piece = self.prefill.attend(layer, qt[s:], kl[s:], vl[s:])
            qt, kl, vl = qt[:s], kl[:s], vl[:s]
        if self.writes is not None:
            rows, pages, slots = self.writes
            self.kv[layer, 0][pages, :, slots] = kl.index_select(0, rows)
            self.kv[layer, 1][pages, :, slots] = vl.index_select(0, rows)
        for base, store in self.stores:
            store(layer, base, q, kl, vl, self)
        for e in self.edits:
            e.before(layer, kl, vl, self)
        kv_lens = self.kv_lens if self.drop is None else self.kv_lens - self.drop[layer]
        wants = any(e.wants_lse for e in self.edits)
        self.lse = qt.new_empty(qt.shape[:2], dtype=torch.float32) if wants else None
        out = self.paged(
            layer, qt, self.page_table, kv_lens, self.q_offsets, self.max_q_len, self.max_kv_len, kl, vl,
            lse_out=self.lse,
        )  # fmt: skip
        for e in self.edits:
            out = e.after(layer, qt, kl, out, self)
        if piece is not None:
            out = torch.cat([out, piece])
        return out.transpose(0, 1)[None]

    def paged(
        self,
        layer: int,
        q: torch.Tensor,
        page_table: torch.Tensor,
        kv_lens: torch.Tensor,
        q_offsets: torch.Tensor,
        max_q_len: int,
        max_kv_len: int,
        k_local: torch.Tensor | None = None,
        v_local: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Split-S attention ``[T, Hq, D]`` of packed queries ``q`` ``[T, Hq, D]`` over layer ``layer``'s
        pool pages (and local K/V, if given), in this round's kernel; each row's natural-log log-sum-exp
        written into ``lse_out`` ``[T, Hq]`` float32 when given."""
        args = (q, self.kv[layer, 0], self.kv[layer, 1], page_table, kv_lens, q_offsets)
        if self.kernel == "triton":
            # today's kernel unless $PDLLM_SPLIT_S=hopper picks the experimental TMA variant
            from pdllm.kernels.split_s_hopper import paged_kernel

            return paged_kernel()(
                *args, k_local=k_local, v_local=v_local, max_q_len=max_q_len, max_kv_len=max_kv_len,
                lse_out=lse_out,
            )  # fmt: skip
        return gathered_attention(q, *args[1:], k_local=k_local, v_local=v_local, lse_out=lse_out)


def gathered_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None = None,
    v_local: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rounds' attention off the GPU: per session, its pages gathered and its local K/V appended, one
    SDPA call (memory-efficient, unlike the split-S kernel's torch reference, whose ``[T, S]`` scores a
    vanilla session's thousands of rows would make gigabytes). Same signature as the kernel; ``lse_out``
    (SDPA does not return its normalizer) is formed from the same keys by :func:`row_lse`."""
    out = torch.empty_like(q)
    offs, lens = q_offsets.tolist(), kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        q0, q1 = offs[b], offs[b + 1]
        if q1 == q0:
            continue
        k, v, _ = gather_request(b, k_pages, v_pages, page_table, kv_len, None)  # every slot valid
        if k_local is not None and v_local is not None:
            k = torch.cat([k, k_local[q0:q1].transpose(0, 1)], 1)
            v = torch.cat([v, v_local[q0:q1].transpose(0, 1)], 1)
        out[q0:q1] = sdpa(q[q0:q1].transpose(0, 1)[None], k[None], v[None])[0].transpose(0, 1)
        if lse_out is not None:
            lse_out[q0:q1] = row_lse(q[q0:q1], k)
    return out


def row_lse(q: torch.Tensor, k: torch.Tensor, max_scores: int = 1 << 24) -> torch.Tensor:
    """``log Σ_j exp(q·k_j / sqrt(D))`` ``[rows, Hq]`` float32 of queries ``[rows, Hq, D]`` over keys
    ``[Hkv, L, D]`` (query head ``h`` reads KV head ``h // G``), in slices of rows of at most
    ``max_scores`` scores, so a long request's ``[Hq, rows, L]`` scores never exist at once."""
    rows, hq, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    g = hq // hkv
    kt = k.float().transpose(1, 2)  # [Hkv, D, L]
    step = max(1, max_scores // max(1, hq * length))
    out = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
    for i in range(0, rows, step):
        part = q[i : i + step].float()
        n = part.shape[0]
        grouped = part.reshape(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
        lse = torch.logsumexp(grouped @ kt * d**-0.5, -1)  # [Hkv, n * G]
        out[i : i + n] = lse.view(hkv, n, g).permute(1, 0, 2).reshape(n, hq)
    return out
