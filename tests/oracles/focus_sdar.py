"""Oracle of FOCUS on SDAR (block diffusion), from scratch: no cache object, one plain loop per step.

The generation blocks are ``block_diffusion.py``'s (aligned to absolute multiples of the generation block
length; the first finishes the prompt's partial block). FOCUS's block is the *window*: the positions from
the generation block's aligned start (where the exact cache of earlier blocks ends) to its end, so the
first window holds the prompt's tail (decoded rows) before the first answer slots. (FOCUS runs on SDAR
only: on Dream/LLaDA it measured no gain over plain decoding.) Per generation block,
the cached prefix ``[0, start)`` is recomputed exactly: one block-causal forward over its final tokens
(the prompt, then the answer's finished blocks), its RoPE'd K/V per layer kept. Per step over the window
(rows ``0 .. w-1`` at positions ``start + r``), with a key set written out per query (block-causal: window
row ``j`` is visible to row ``i`` iff ``(start + j) // bs <= (start + i) // bs``; the prefix always):

1. Layers 0 and 1 run on every unfrozen row; their window keys are every row's latest K/V (a frozen row's
   from the step that froze it). Importance (:func:`importance`, Eq. 2, over the forwarded queries and all
   ``w`` window keys, no mask: the block's rows only) gives ``dI = I(1) - I(0)``.
2. Budget (Eqs. 4-5): ``K = min(B, max(ceil(alpha * Nbar), N_sigma))``, ``Nbar`` the decode's mean tokens
   unmasked per step so far (1 before its first step, kept across windows), ``N_sigma`` the masked rows
   with ``dI >= std(dI)`` (population std); a fixed ``budget`` replaces it; under the fixed schedule
   K >= the step's quota. Selection (Algorithm 1 lines 16-18): the K masked rows of largest dI (ties: the
   lower row), their predecessors, every masked row from the visible prefix's end up to the selection's
   last row (placeholder integrity), the decoded rows not frozen.
3. Layers >= 2 run on the selected rows; their window keys are rows ``[0, reach)`` (reach: one past every
   row ever forwarded past layer 1 in this window), each with the K/V of the last step that forwarded it.
4. Logits are unshifted (SDAR): every selected masked row is eligible; the sampler (``plain.py``'s rules:
   fixed schedule or threshold, greedy) picks among those.
5. Delayed cache: a decoded row whose right neighbour is decoded (the window's last row: once decoded) is
   forwarded once more, then frozen for the rest of the window.

Counters: ``forwards`` (denoising steps; the record of a finished block is not one), ``rows_forwarded`` /
``rows_plain`` (rows through layers >= 2, summed over those layers; plain: the whole window),
``rows_prefix`` (rows through layers 0-1), ``focused`` / ``evicted`` (masked rows kept / not), ``frozen``
(frozen rows skipped), ``decoded``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .block_diffusion import spans
from .plain import finish, greedy, head, project, rope, schedule


def importance(q: torch.Tensor, k: torch.Tensor, kernel: int) -> list[float]:
    """Eq. 2 from queries ``[Hq, n, D]`` and the block's keys ``[Hkv, B, D]``."""
    heads, kv_heads, d = q.shape[0], k.shape[0], q.shape[2]
    keys = k.double().repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.einsum("hid,hjd->hij", q.double(), keys) / math.sqrt(d)
    r = kernel // 2
    padded = F.pad(scores, (r, r), value=float("-inf"))
    pooled = padded.unfold(-1, kernel, 1).amax(-1)
    return torch.softmax(pooled, dim=-1).sum(dim=(0, 1)).tolist()


# what FOCUS counts per request (the runtime's ``FocusStats`` names)
COUNTERS = (
    "forwards",
    "rows_forwarded",
    "rows_plain",
    "rows_prefix",
    "focused",
    "evicted",
    "frozen",
    "decoded",
)


def _prefix_kv(model, seq: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K/V ``[1, Hkv, n, D]`` of ``seq`` at positions ``0..n-1`` under the block-causal mask."""
    n, size = len(seq), model.config.block_size
    kv = []
    if n == 0:
        c = model.config
        empty = torch.zeros(1, c.num_kv_heads, 0, c.head_dim)
        return [(empty, empty) for _ in model.model.layers]
    blocks = torch.arange(n) // size
    mask = blocks[None, :] <= blocks[:, None]
    cos, sin = rope(model, torch.arange(n))
    x = model.model.embed_tokens(torch.tensor(seq))
    for layer in model.model.layers:
        q, k, v = project(layer, x, cos, sin)
        kv.append((k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        x = finish(layer, x, out)
    return kv


def _stable(masked: list[bool], frozen: list[bool]) -> list[bool]:
    """Rows to freeze after the next forward: decoded, right neighbour decoded (or none), not frozen."""
    w = len(masked)
    return [not masked[r] and (r + 1 == w or not masked[r + 1]) and not frozen[r] for r in range(w)]


def _layer(
    layer,
    x: torch.Tensor,
    rows: list[int],
    visible: list[int],
    store: dict[int, tuple[torch.Tensor, torch.Tensor]],
    prefix: tuple[torch.Tensor, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    mblock: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer for window ``rows`` (inputs ``x``): writes their K/V into ``store`` (window row -> (k, v)
    ``[Hkv, D]``), then each query attends to the cached ``prefix`` and to the ``visible`` window rows of
    model blocks (``mblock``) <= its own, read from the store. Returns (outputs, queries ``[Hq, n, D]``,
    the visible window keys ``[Hkv, len(visible), D]``)."""
    q, k, v = project(layer, x, cos[rows], sin[rows])
    for i, r in enumerate(rows):
        store[r] = (k[0, :, i], v[0, :, i])
    keys = torch.stack([store[j][0] for j in visible], dim=1)[None]
    values = torch.stack([store[j][1] for j in visible], dim=1)[None]
    pk, pv = prefix
    keys, values = torch.cat([pk, keys], dim=2), torch.cat([pv, values], dim=2)
    seen = mblock[visible][None, :] <= mblock[rows][:, None]
    mask = torch.cat([torch.ones(len(rows), pk.shape[2], dtype=torch.bool), seen], dim=1)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1]
    )
    return finish(layer, x, out), q[0], keys[0, :, pk.shape[2] :]


@torch.inference_mode()
def focus_sdar(
    model,
    prompt: list[int],
    gen_length: int,
    block: int,
    steps: int,
    threshold: float | None,
    alpha: float = 1.5,
    kernel: int = 3,
    budget: int | None = None,
    delayed_cache: bool = True,
) -> tuple[list[int], dict[str, int]]:
    """The answer (every slot filled) and FOCUS's counters."""
    cfg = model.config
    mask_id, size, layers = cfg.mask_token_id, cfg.block_size, list(model.model.layers)
    assert len(layers) >= 2 and block % size == 0
    seq = list(prompt) + [mask_id] * gen_length
    per_block = steps // (gen_length // block)
    counters = dict.fromkeys(COUNTERS, 0)
    unmasked_total, steps_total = 0, 0
    deep = len(layers) - 2
    for lo, hi in spans(len(prompt), gen_length, block):
        start = lo // block * block  # the cache's end: the window is [start, hi)
        prefix = _prefix_kv(model, seq[:start])
        w = hi - start
        positions = torch.arange(start, hi)
        cos_all, sin_all = rope(model, positions)
        mblock = positions // size
        # store[layer][r]: (k, v) ``[Hkv, D]`` of window row r from the last step that forwarded it there.
        store: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in layers]
        masked = [seq[start + r] == mask_id for r in range(w)]
        frozen = [False] * w

        pending = _stable(masked, frozen) if delayed_cache else [False] * w
        reach = 0
        counts = schedule(hi - lo, per_block)
        s = 0

        while masked_rows := [r for r in range(w) if masked[r]]:
            quota = None
            if threshold is None:
                quota = len(masked_rows) if s >= len(counts) - 1 else min(counts[s], len(masked_rows))

            # Layers 0-1 over every unfrozen row; all w rows are keys (frozen ones from the store).
            active = [r for r in range(w) if not frozen[r]]
            x = model.model.embed_tokens(torch.tensor([seq[start + r] for r in active]))
            captured = []
            for li in (0, 1):
                x, q, keys = _layer(
                    layers[li], x, active, list(range(w)), store[li], prefix[li], cos_all, sin_all, mblock
                )
                captured.append((q, keys))
            d1, d0 = importance(*captured[1], kernel), importance(*captured[0], kernel)
            delta = [a - b for a, b in zip(d1, d0, strict=True)]

            # Budget and selection.
            mean = sum(delta) / w
            sigma = math.sqrt(sum((d - mean) ** 2 for d in delta) / w)
            n_sigma = sum(1 for j in masked_rows if delta[j] >= sigma)
            n_bar = 1.0 if steps_total == 0 else unmasked_total / steps_total
            k = budget if budget is not None else min(block, max(math.ceil(alpha * n_bar), n_sigma))
            if quota is not None:
                k = max(k, quota)
            top = sorted(masked_rows, key=lambda j: (-delta[j], j))[:k]
            chosen = set(top) | {j - 1 for j in top if j > 0}
            last = max(chosen)
            chosen |= {j for j in masked_rows if reach <= j < last}
            chosen |= {r for r in range(w) if not masked[r] and not frozen[r]}
            sel = sorted(chosen)
            new_reach = max(reach, sel[-1] + 1)

            # Layers >= 2 over the selected rows; keys: rows [0, reach).
            where = {r: i for i, r in enumerate(active)}
            x = x[[where[r] for r in sel]]
            for li in range(2, len(layers)):
                x, _, _ = _layer(
                    layers[li],
                    x,
                    sel,
                    list(range(new_reach)),
                    store[li],
                    prefix[li],
                    cos_all,
                    sin_all,
                    mblock,
                )

            # Sampler among the eligible rows (every selected masked row: unshifted logits).
            eligible = [j for j in sel if masked[j]]
            at = {r: i for i, r in enumerate(sel)}
            conf, pred = greedy(head(model, x[[at[j] for j in eligible]]), mask_id)
            if threshold is None:
                order = torch.sort(conf, descending=True, stable=True).indices
                chosen_idx = order[: min(quota, len(eligible))].tolist()
            else:
                chosen_idx = (conf > threshold).nonzero().flatten().tolist() or [int(conf.argmax())]
            picked = sorted(eligible[c] for c in chosen_idx)

            c = counters
            c["forwards"] += 1
            c["rows_forwarded"] += len(sel) * deep
            c["rows_plain"] += w * deep
            c["rows_prefix"] += len(active) * 2
            c["focused"] += len(eligible)
            c["evicted"] += len(masked_rows) - len(eligible)
            c["frozen"] += w - len(active)
            c["decoded"] += len(picked)

            # Observe: the pending rows were forwarded by this step -> frozen; then the new stable rows.
            reach = new_reach
            frozen = [f or p for f, p in zip(frozen, pending, strict=True)]
            for c_i in chosen_idx:
                seq[start + eligible[c_i]] = int(pred[c_i])
            for r in picked:
                masked[r] = False
            unmasked_total += len(picked)
            steps_total += 1
            if delayed_cache:
                pending = _stable(masked, frozen)
            s += 1
    return seq[len(prompt) :], counters
