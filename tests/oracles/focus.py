"""Oracle of FOCUS (``/work/shared/papers/focus.txt``: §3-4, Algorithm 1, App. E-F) on Dream / LLaDA, over
the semi-autoregressive blocks of the response (block rows ``[0, B)`` at local rows ``[lo, lo + B)``; every
other local row is context, forwarded in full as in plain decoding).

Per step:

1. Layers 0 and 1 run on every row but the block's frozen ones; their block keys are every block row's
   latest K/V (a frozen row's from the forward that froze it).
2. **Importance** (Eqs. 2-3): ``I_j = sum_{h,i} softmax_j(maxpool_j(q_i . k_j / sqrt(d)))`` over the
   block's forwarded queries i and its keys j (max-pool window ``pool_kernel`` over the keys, edges pooling
   over their real neighbours), in float64; ``dI = I(layer 1) - I(layer 0)``.
3. **Budget** (Eqs. 4-5): ``K = min(B, max(ceil(alpha * Nbar), N_sigma))``, with ``Nbar`` the decode's mean
   tokens unmasked per step so far (1 before its first step, kept across blocks) and ``N_sigma`` the masked
   rows with ``dI >= std(dI)`` (population std over the block's rows); a fixed ``budget`` replaces it;
   under the fixed schedule K is raised to the step's quota.
4. **Selection** (Algorithm 1 lines 16-18): the K masked rows of largest dI (ties: the lower row), their
   predecessors, every masked row from the visible prefix's end up to the selection's last row, and the
   decoded rows not frozen. Layers >= 2 run on those rows (plus the context); their block keys are the
   block rows ``[0, reach)`` (reach: one past every block row ever forwarded past layer 1 in the block).
5. **Logits** only for the selected masked rows whose predicting row (Dream: the row before) was forwarded;
   the sampler unmasks among those only.
6. **Intra-block cache** (§4.3, ``delayed_cache``): a decoded row whose right neighbour is decoded (the
   block's last row: once decoded) is forwarded once more, then frozen for the rest of the block.

Counters: forwards; rows through layers >= 2 (``rows_forwarded``) and what plain decoding would forward
there (``rows_plain``), both summed over those layers; rows through layers 0-1 (``rows_prefix``); masked
rows kept (``focused``) and evicted (``evicted``); frozen rows skipped (``frozen``); tokens ``decoded``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .plain import Static, Step, attend, finish, head, project, rope, unmask


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


class FocusOracle:
    def __init__(
        self,
        model,
        head_tokens: list[int],
        gen_length: int,
        block: int,
        alpha: float = 1.5,
        kernel: int = 3,
        budget: int | None = None,
        delayed_cache: bool = True,
        static: Static = None,
        first_position: int = 0,
    ) -> None:
        assert model.config.num_layers >= 2
        self.model, self.static, self.width = model, static, block
        self.alpha, self.kernel, self.budget, self.delayed = alpha, kernel, budget, delayed_cache
        self.local = torch.tensor(head_tokens + [model.config.mask_token_id] * gen_length)
        self.rows = self.local.numel()
        self.cos, self.sin = rope(model, torch.arange(first_position, first_position + self.rows))
        self.response_start = len(head_tokens)
        self.lead = 1 if model.config.shift_logits else 0
        self.layers = list(model.model.layers)
        cfg = model.config
        shape = (1, cfg.num_kv_heads, block, cfg.head_dim)
        self.store_k = [torch.zeros(shape) for _ in self.layers]
        self.store_v = [torch.zeros(shape) for _ in self.layers]
        # Decode-wide: tokens unmasked and steps taken (Nbar); per block: the row flags and the reach.
        self.unmasked_total, self.steps_total = 0, 0
        self.block = -1
        self.masked: list[bool] = []
        self.frozen: list[bool] = []
        self.pending: list[bool] = []
        self.reach, self.next_reach = 0, 0
        self.budgets: list[int] = []  # K of every step
        self.counters = dict.fromkeys(COUNTERS, 0)

    def _stable(self) -> list[bool]:
        m, n = self.masked, self.width
        return [not m[r] and (r + 1 == n or not m[r + 1]) and not self.frozen[r] for r in range(n)]

    def _layer(self, li: int, x: torch.Tensor, rows: list[int], fresh: list[int], visible: int, lo: int):
        """Layer ``li`` for the local ``rows`` (inputs ``x``); ``fresh``: their block rows (written to the
        store); keys: the context rows, then block rows ``[0, visible)`` from the store. Returns (outputs,
        the block queries ``[Hq, n, D]``, the block keys ``[Hkv, visible, D]``)."""
        layer = self.layers[li]
        idx = torch.tensor(rows)
        q, k, v = project(layer, x, self.cos[idx], self.sin[idx])
        n = len(fresh)
        self.store_k[li][:, :, fresh] = k[:, :, lo : lo + n]
        self.store_v[li][:, :, fresh] = v[:, :, lo : lo + n]
        keys = torch.cat([k[:, :, :lo], self.store_k[li][:, :, :visible], k[:, :, lo + n :]], dim=2)
        values = torch.cat([v[:, :, :lo], self.store_v[li][:, :, :visible], v[:, :, lo + n :]], dim=2)
        out = attend(q, keys, values, self.static, li)
        return finish(layer, x, out), q[0, :, lo : lo + n], self.store_k[li][0, :, :visible]

    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        self.local[self.response_start :] = response
        lo, hi = self.response_start + step.lo, self.response_start + step.hi
        if step.block != self.block:
            self.block = step.block
            self.masked = [int(t) == self.model.config.mask_token_id for t in self.local[lo:hi]]
            self.frozen = [False] * self.width
            self.pending = self._stable() if self.delayed else [False] * self.width
            self.reach = 0
        masked_rows = [r for r in range(self.width) if self.masked[r]]
        assert [lo + r for r in masked_rows] == [self.response_start + p for p in step.masked]
        before, after = list(range(lo)), list(range(hi, self.rows))

        # Layers 0-1 over every unfrozen row.
        active = [r for r in range(self.width) if not self.frozen[r]]
        rows0 = before + [lo + r for r in active] + after
        x = self.model.model.embed_tokens(self.local[None, rows0])[0]
        captured = []
        for li in (0, 1):
            x, q, k = self._layer(li, x, rows0, active, self.width, lo)
            captured.append((q, k))
        d1, d0 = importance(*captured[1], self.kernel), importance(*captured[0], self.kernel)
        delta = [a - b for a, b in zip(d1, d0)]

        # Budget and selection.
        mean = sum(delta) / len(delta)
        sigma = math.sqrt(sum((v - mean) ** 2 for v in delta) / len(delta))
        n_sigma = sum(1 for j in masked_rows if delta[j] >= sigma)
        n_bar = 1.0 if self.steps_total == 0 else self.unmasked_total / self.steps_total
        k = (
            self.budget
            if self.budget is not None
            else min(self.width, max(math.ceil(self.alpha * n_bar), n_sigma))
        )
        if step.quota is not None:
            k = max(k, step.quota)
        self.budgets.append(k)
        top = sorted(masked_rows, key=lambda j: (-delta[j], j))[:k]
        chosen = set(top) | {j - 1 for j in top if j > 0}
        last = max(chosen)
        chosen |= {j for j in masked_rows if self.reach <= j < last}
        chosen |= {r for r in range(self.width) if not self.masked[r] and not self.frozen[r]}
        sel = sorted(chosen)
        self.next_reach = max(self.reach, sel[-1] + 1)

        # Layers >= 2 over the selected rows.
        rows1 = before + [lo + r for r in sel] + after
        where0 = {r: i for i, r in enumerate(rows0)}
        x = x[[where0[r] for r in rows1]]
        for li in range(2, len(self.layers)):
            x, _, _ = self._layer(li, x, rows1, sel, self.next_reach, lo)

        kept = set(sel)
        eligible = [j for j in sel if self.masked[j] and (self.lead == 0 or j == 0 or j - 1 in kept)]
        where1 = {r: i for i, r in enumerate(rows1)}
        computed = head(self.model, x[[where1[lo + j - self.lead] for j in eligible]])
        logits = torch.zeros(len(masked_rows), computed.shape[-1])
        allowed = torch.zeros(len(masked_rows), dtype=torch.bool)
        slot = {r: i for i, r in enumerate(masked_rows)}
        for i, j in enumerate(eligible):
            logits[slot[j]] = computed[i]
            allowed[slot[j]] = True

        deep = len(self.layers) - 2
        focused = sum(1 for r in sel if self.masked[r])
        c = self.counters
        c["forwards"] += 1
        c["rows_forwarded"] += len(rows1) * deep
        c["rows_plain"] += self.rows * deep
        c["rows_prefix"] += len(rows0) * 2
        c["focused"] += focused
        c["evicted"] += len(masked_rows) - focused
        c["frozen"] += self.width - len(active)
        return logits, allowed

    def observe(self, step: Step, picked: list[int]) -> None:
        self.reach = self.next_reach
        self.frozen = [f or p for f, p in zip(self.frozen, self.pending)]
        for p in picked:
            self.masked[p - step.lo] = False
        self.unmasked_total += len(picked)
        self.steps_total += 1
        self.counters["decoded"] += len(picked)
        if self.delayed:
            self.pending = self._stable()


@torch.inference_mode()
def focus_decode(
    model,
    head_tokens: list[int],
    gen_length: int,
    block: int,
    steps: int,
    threshold: float | None,
    alpha: float = 1.5,
    kernel: int = 3,
    budget: int | None = None,
    delayed_cache: bool = True,
    static: Static = None,
    first_position: int = 0,
) -> tuple[list[int], dict[str, int], FocusOracle]:
    oracle = FocusOracle(
        model, head_tokens, gen_length, block, alpha, kernel, budget, delayed_cache, static, first_position
    )
    tokens, _ = unmask(model.config.mask_token_id, gen_length, block, steps, threshold, oracle)
    return tokens, oracle.counters, oracle
