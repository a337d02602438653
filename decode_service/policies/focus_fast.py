"""FOCUS's fast path (``focus.py``): one step of several requests at once, held to the reference.

The requests' forwarded rows are packed into one ragged batch (no padding): the projections, MLPs and LM
head run once over all of them, so what eviction saves in one request makes room for others (§4: "the
effective batch grows"). Per step:

1. layers 0-1 over every unfrozen row of every request, packed;
2. the importance delta (Eq. 2-3) and the selection (Eqs. 4-5, Algorithm 1 lines 14-18) as tensor ops over
   all requests at once, blocks padded to one width;
3. **one host read**: the selected rows of every request (the packed shapes of the rest depend on it);
4. layers >= 2 over the selected rows, packed; the LM head over the eligible rows, packed.

Attention stays per request (its own context: SDAR's cache of earlier blocks, pdllm's static KV): a loop
of SDPA calls over slices of the packed q/k/v, the CPU stand-in for a ragged (varlen) attention kernel.
Block K/V live in one :class:`~.focus_layers.BlockKV` with a slot per request, written for all requests
by one ``index_copy_`` per layer. The sampler's own read of the predictions (``predict_many``, one per
round for all requests) comes on top, as for every decode round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM

from .focus import FocusConfig, FocusMemory, FocusStats
from .focus_layers import BlockKV, RowsAttention, embed, keys_in_row_order


@dataclass
class FocusRequest:
    """One request's share of a batched step: its local rows (``tokens`` / ``positions`` ``[T]``, on the
    model's device), the block ``[lo, hi)``, the masked local rows ``at`` (ascending, host) whose logits
    the sampler needs, its attention, the fixed schedule's ``quota`` and its FOCUS state."""

    slot: int
    tokens: torch.Tensor
    positions: torch.Tensor
    lo: int
    hi: int
    at: list[int]
    attention: RowsAttention
    quota: int | None
    memory: FocusMemory
    stats: FocusStats
    reach: int = field(default=0, init=False)  # set by the step, read by :meth:`FocusBatch.observe`


def importance_batched(
    q: torch.Tensor, k: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, kernel: int
) -> torch.Tensor:
    """Eq. 2 for ``R`` padded blocks: ``q`` ``[R, Hq, W, D]``, ``k`` ``[R, Hkv, W, D]``; ``queries`` /
    ``keys`` ``[R, W]`` mark the real query / key rows. ``[R, W]`` float64 (padded keys: 0)."""
    r, heads, w, dim = q.shape
    keys_d = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    scores = q.double() @ keys_d.transpose(-1, -2) / math.sqrt(dim)  # [R, Hq, W, W]
    outside = ~keys[:, None, None, :]
    scores = scores.masked_fill(outside, float("-inf"))  # a real key never pools a padded one
    if kernel > 1:
        scores = F.max_pool1d(scores.reshape(-1, 1, w), kernel, 1, kernel // 2).reshape(scores.shape)
        scores = scores.masked_fill(outside, float("-inf"))  # nor does a padded key pool a real one
    weights = torch.softmax(scores, dim=-1) * queries[:, None, :, None]
    return weights.sum(dim=(1, 2))


def select_batched(
    delta: torch.Tensor,
    masked: torch.Tensor,
    frozen: torch.Tensor,
    valid: torch.Tensor,
    reach: torch.Tensor,
    k_hist: torch.Tensor,
    quota: torch.Tensor,
    config: FocusConfig,
    block_length: int,
) -> torch.Tensor:
    """Algorithm 1 lines 7-18 for ``R`` padded blocks (``[R, W]``; ``reach`` / ``k_hist`` / ``quota``
    ``[R]``, quota 0 where none): the rows forwarded past layer 1, ``[R, W]`` bool."""
    count = valid.sum(-1, keepdim=True).to(delta.dtype)
    d = delta.masked_fill(~valid, 0.0)
    mean = d.sum(-1, keepdim=True) / count
    sigma = (((d - mean) * valid) ** 2).sum(-1, keepdim=True).div(count).sqrt()
    n_sigma = (masked & (delta >= sigma)).sum(-1)  # Eq. 5
    if config.budget is not None:
        k = torch.full_like(n_sigma, config.budget)
    else:
        k = torch.clamp(torch.maximum(k_hist, n_sigma), max=block_length)  # Eq. 4
    k = torch.maximum(k, quota)
    rows = torch.arange(delta.shape[1], device=delta.device).expand_as(delta)
    key = delta.masked_fill(~masked, float("-inf"))
    # A stable descending sort ranks ties by row, as the reference's (-dI, row) order does.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, rows)
    top = masked & (rank < k[:, None])
    chosen = top | F.pad(top[:, 1:], (0, 1))  # AR-context preservation: row j when j + 1 is on top
    last = torch.where(chosen, rows, -1).max(-1, keepdim=True).values
    placeholders = masked & (rows >= reach[:, None]) & (rows < last)
    return chosen | placeholders | (valid & ~masked & ~frozen)


@dataclass
class _Packed:
    """The attention of one phase over the packed rows of several requests: per request, its forwarded
    block rows are written into its store slot (one ``index_copy_`` for all), then its slice of q attends
    to its keys in row order. ``capture``: layers 0-1's q and block keys, padded ``[R, H, W, D]``."""

    store: BlockKV
    requests: list[FocusRequest]
    offsets: list[int]  # packed start of each request's rows
    counts: list[int]  # its forwarded block rows
    visible: list[int]
    attends: list[AttentionBackend]
    store_rows: torch.Tensor  # slot * width + block row, per forwarded block row (request order)
    packed_rows: torch.Tensor  # their packed indices
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    pad_rows: torch.Tensor | None = None  # request * width + block row, for the captured q

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pick = self.packed_rows
        self.store.write(layer, self.store_rows, k[:, :, pick], v[:, :, pick])
        if self.capture is not None:
            assert self.pad_rows is not None
            w = self.store.width
            qpad = q.new_zeros(len(self.requests) * w, q.shape[1], q.shape[3])
            qpad.index_copy_(0, self.pad_rows, q[0][:, pick].transpose(0, 1))
            slots = torch.tensor([r.slot for r in self.requests], device=q.device)
            kpad = self.store.keys[layer].index_select(0, slots)  # [R, W, Hkv, D]
            self.capture[layer] = (
                qpad.view(len(self.requests), w, *qpad.shape[1:]).transpose(1, 2),
                kpad.transpose(1, 2),
            )
        outs = []
        for i, req in enumerate(self.requests):
            s, n = self.offsets[i], self.offsets[i + 1] - self.offsets[i]
            kb, vb = self.store.block(layer, req.slot)
            ks = keys_in_row_order(k[:, :, s : s + n], kb, req.lo, self.counts[i], self.visible[i])
            vs = keys_in_row_order(v[:, :, s : s + n], vb, req.lo, self.counts[i], self.visible[i])
            outs.append(self.attends[i](layer, q[:, :, s : s + n], ks, vs))
        return torch.cat(outs, dim=2)


def _block_rows(values: list[bool], width: int) -> list[bool]:
    return values + [False] * (width - len(values))


class FocusBatch:
    """FOCUS steps of up to ``slots`` requests together (the fast path): :meth:`step` returns each
    request's logits and eligible rows, as :meth:`~.focus_reference.FocusReference.step` does for one;
    after the sampler, :meth:`observe` each request."""

    def __init__(self, model: DiffusionLM, focus: FocusConfig, block_length: int, slots: int) -> None:
        self.model, self.focus, self.block_length = model, focus, block_length
        self.lead = 1 if model.config.shift_logits else 0
        self.store = BlockKV(model, slots, block_length)

    def start(self, req: FocusRequest, block: int, masked: list[bool]) -> None:
        """Begin block ``block`` of ``req`` (a no-op while it is the current one)."""
        if block != req.memory.block:
            req.memory.start_block(block, masked, self.focus.delayed_cache)

    def _phase(
        self, requests: list[FocusRequest], rows: list[list[int]], block: list[list[int]], visible: list[int]
    ) -> tuple[_Packed, list[int]]:
        """The packed attention of a phase where request i forwards local ``rows[i]`` (its forwarded
        ``block`` rows among them) and sees its block rows ``[0, visible[i])``."""
        dev, w = requests[0].tokens.device, self.block_length
        offsets, store_rows, packed_rows, pad_rows, attends = [0], [], [], [], []
        for i, req in enumerate(requests):
            start = offsets[-1]
            packed_rows += [start + req.lo + j for j in range(len(block[i]))]
            store_rows += [req.slot * w + r for r in block[i]]
            pad_rows += [i * w + r for r in block[i]]
            keys = [*range(req.lo + visible[i]), *range(req.hi, req.tokens.numel())]
            attends.append(req.attention(torch.tensor(rows[i], device=dev), torch.tensor(keys, device=dev)))
            offsets.append(start + len(rows[i]))
        index = [torch.tensor(x, dtype=torch.long, device=dev) for x in (store_rows, packed_rows, pad_rows)]
        counts = [len(b) for b in block]
        packed = _Packed(self.store, requests, offsets, counts, visible, attends, index[0], index[1])
        packed.pad_rows = index[2]
        return packed, offsets

    @torch.inference_mode()
    def step(self, requests: list[FocusRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One step of every request: ``(logits [len(at), V], eligible bool (host))`` each."""
        model, w, dev = self.model, self.block_length, requests[0].tokens.device
        widths = [r.hi - r.lo for r in requests]
        active = [
            [r for r in range(n) if not q.memory.frozen[r]] for q, n in zip(requests, widths, strict=True)
        ]
        rows0 = [
            [*range(q.lo), *(q.lo + r for r in a), *range(q.hi, q.tokens.numel())]
            for q, a in zip(requests, active, strict=True)
        ]
        bases = torch.tensor([0, *(q.tokens.numel() for q in requests)]).cumsum(0).tolist()
        flat = torch.tensor([bases[i] + r for i, rows in enumerate(rows0) for r in rows], device=dev)
        tokens = torch.cat([q.tokens for q in requests]).index_select(0, flat)
        positions = torch.cat([q.positions for q in requests]).index_select(0, flat)
        x, cos, sin = embed(model, tokens, positions)
        phase0, offsets0 = self._phase(requests, rows0, active, widths)
        phase0.capture = captured = {}
        for layer in model.model.layers[:2]:
            x = layer(x, cos, sin, phase0)

        def table(values: list[list[bool]]) -> torch.Tensor:
            return torch.tensor([_block_rows(v, w) for v in values], dtype=torch.bool, device=dev)

        masked = table([q.memory.masked for q in requests])
        frozen = table([q.memory.frozen for q in requests])
        valid = table([[True] * n for n in widths])
        per = [[q.memory.reach, q.memory.k_hist(self.focus.alpha), q.quota or 0] for q in requests]
        reach, k_hist, quota = torch.tensor(per, device=dev).unbind(1)
        kernel, queries = self.focus.pool_kernel, valid & ~frozen
        delta = importance_batched(*captured[1], queries, valid, kernel) - importance_batched(
            *captured[0], queries, valid, kernel
        )
        chosen = select_batched(delta, masked, frozen, valid, reach, k_hist, quota, self.focus, w)
        chosen_host = chosen.cpu()  # the step's one host read: the packed shapes below depend on it

        selected = [chosen_host[i, :n].nonzero().flatten().tolist() for i, n in enumerate(widths)]
        rows1, keep = [], []
        for i, (q, sel) in enumerate(zip(requests, selected, strict=True)):
            q.reach = max(q.memory.reach, sel[-1] + 1)
            rows1.append([*range(q.lo), *(q.lo + r for r in sel), *range(q.hi, q.tokens.numel())])
            where = {r: j for j, r in enumerate(rows0[i])}
            keep += [offsets0[i] + where[r] for r in rows1[i]]
        keep_t = torch.tensor(keep, device=dev)
        x, cos, sin = x[:, keep_t], cos[:, keep_t], sin[:, keep_t]
        phase1, offsets1 = self._phase(requests, rows1, selected, [q.reach for q in requests])
        for layer in model.model.layers[2:]:
            x = layer(x, cos, sin, phase1)
        hidden = model.model.norm(x)
        return self._logits(requests, hidden, rows0, rows1, offsets1, selected)

    def _logits(
        self,
        requests: list[FocusRequest],
        hidden: torch.Tensor,
        rows0: list[list[int]],
        rows1: list[list[int]],
        offsets1: list[int],
        selected: list[list[int]],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The LM head over every request's eligible rows at once; the counters."""
        dev, deep = hidden.device, self.model.config.num_layers - 2
        src: list[int] = []
        places: list[list[int]] = []
        for i, (q, sel) in enumerate(zip(requests, selected, strict=True)):
            masked, kept = q.memory.masked, set(sel)
            eligible = [j for j in sel if masked[j] and (self.lead == 0 or j == 0 or j - 1 in kept)]
            where = {r: j for j, r in enumerate(rows1[i])}
            src += [offsets1[i] + where[q.lo + j - self.lead] for j in eligible]
            slot = {r - q.lo: j for j, r in enumerate(q.at)}
            places.append([slot[j] for j in eligible])
            n_kept = sum(1 for r in sel if masked[r])
            s = q.stats
            s.forwards += 1
            s.rows_forwarded += len(rows1[i]) * deep
            s.rows_plain += q.tokens.numel() * deep
            s.rows_prefix += len(rows0[i]) * 2
            s.focused += n_kept
            s.evicted += len(q.at) - n_kept
            s.frozen += sum(q.memory.frozen)
        computed = self.model.lm_head(hidden[:, torch.tensor(src, device=dev)])[0]
        out, start = [], 0
        for q, place in zip(requests, places, strict=True):
            rows = torch.tensor(place, device=dev)
            part = computed[start : start + len(place)]
            start += len(place)
            logits = part.new_zeros(len(q.at), part.shape[-1]).index_copy_(0, rows, part)
            eligible = torch.zeros(len(q.at), dtype=torch.bool)
            eligible[place] = True  # from the host list: no device read
            out.append((logits, eligible))
        return out

    def observe(self, req: FocusRequest, picked: list[int]) -> None:
        """The sampler unmasked block rows ``picked`` of ``req`` after the last :meth:`step`."""
        req.memory.observe(picked, req.reach, self.focus.delayed_cache)
        req.stats.decoded += len(picked)
