"""FOCUS (Liang et al., ``/work/shared/papers/focus.txt``): forward only the block tokens that can be decoded.

A decode step forwards a whole block although it unmasks only a few of its tokens (§2: ~10%). FOCUS
predicts which masked tokens are decodable from the first two layers and evicts the others from the rest
of the forward (§4, Algorithm 1). It runs on SDAR (block diffusion) models only; on Dream/LLaDA it measured
no gain over plain decoding (a request naming it there is refused, ``decode_service/sessions.py``). Per
step, over the current block's rows (the generation block's window over the exact cache of earlier
blocks):

1. **Importance delta** (§3.1-3.2, Eqs. 2-3): layers 0 and 1 run on every unfrozen row (Algorithm 1
   line 5); from their queries and keys, ``I_j = sum_{i,h} softmax_j(maxpool_j(S_ij^h))`` with
   ``S = QK^T / sqrt(d)`` over the block's rows only (queries i and keys j both in the block; MaxPool1D
   kernel 3, §F.1 / Eq. 15), and ``dI = I(layer 1) - I(layer 0)``. Every softmax row sums to 1 in both
   layers, so dI has mean 0 (§4.1's "zero-mean distribution").
2. **Dynamic budget** (§4.1, Eqs. 4-5, 17-19): ``K = min(B, max(ceil(alpha * Nbar), N_sigma))``, Nbar
   the request's mean tokens unmasked per step so far (1 before its first step; kept across blocks, E.3.1;
   the cumulative mean of Eqs. 17-19, where E.3.2 says "exponential"), ``N_sigma`` the masked tokens with
   ``dI >= Std(dI)`` (population std over the block's rows; E.2.2's ``dI > mean + std`` is the same test
   but for ties, the mean being 0).
3. **Selection** (§4.2, Algorithm 1 lines 16-18): the K masked rows of largest dI (ties: the lower row),
   plus each one's predecessor (**AR-context preservation**), plus every masked row before the selection's
   last one that no earlier step of this block forwarded past layer 1 (**placeholder integrity**: it then
   has K/V to be attended to; E.3.1's ``rightmost_processed``), plus the block's decoded rows that are not
   frozen (context). Layers >= 2 run on those rows only (the paper also finishes layer 1 on them only,
   line 21; here layer 1 runs whole, which gives the kept rows the same values); the evicted rows stay
   visible at layers >= 2 through the K/V of the last step that forwarded them ("fixed reference KV
   states"); rows never forwarded past layer 1 in this block are not visible there.
4. **Intra-block KV cache with the Neighbor-Aware Stability Criterion** (§4.3, E.3.1; ``delayed_cache``):
   a decoded row whose right neighbour is decoded too is forwarded once more, then frozen: later steps
   of the block skip it at every layer and read its K/V from that forward. The block's last row has no
   right neighbour inside the block and counts as stable once decoded.
5. **Unmasking** stays the sampler's (``sampler.DenoiseState``, confidence threshold or schedule): it
   chooses among the *eligible* rows only, the masked rows of the selection, whose logits were computed
   (SDAR's logits are unshifted: row j's from row j). Under the fixed schedule the budget is raised to the step's quota
   (``DenoiseState.quota``), so the schedule (and the number of steps) is plain decoding's.

**Degenerate knobs**: ``budget >= block length`` keeps every masked row (nothing evicted); with
``delayed_cache=False`` too, every step forwards every row and equals plain decoding token for token.

This module holds the per-request host state (:class:`FocusMemory`, :class:`FocusStats`; the knobs,
:class:`FocusConfig`, are ``shared/decode_policy.py``'s). ``focus_select.py`` runs steps 1-3 vectorized over
several requests (the rounds, ``decode_service/sdar_focus_rounds.py``); the reference loop
``tests/reference/focus.py`` writes them out plainly for one request, and the rounds are held to it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pdllm.shared.decode_policy import FocusConfig

__all__ = ["ONLY_SDAR", "FocusConfig", "FocusMemory", "FocusStats", "check_model"]


ONLY_SDAR = (
    "decode policy 'focus' runs on block-diffusion (SDAR) models only; on Dream/LLaDA it measured no gain "
    "over plain decoding"
)
"""The refusal of FOCUS on a Dream/LLaDA model (``decode_service/sessions.check_policy_family``)."""


def check_model(model: Any) -> None:
    """FOCUS runs block by block over the exact cache of an SDAR model and needs layers 0 and 1 for its
    delta."""
    config = model.config
    if config.block_size is None:
        raise ValueError(f"{ONLY_SDAR} (got {config.family!r})")
    if config.num_layers < 2:
        raise ValueError(
            f"FOCUS needs a model of >= 2 layers (its delta reads layers 0 and 1), got {config.num_layers}"
        )


@dataclass
class FocusStats:
    """Counters of one request: ``rows_forwarded`` / ``rows_plain``: rows through layers >= 2 summed over
    those layers, under FOCUS and under plain decoding (the paper's Table 5 counts layer 2+);
    ``rows_prefix``: rows through layers 0-1 (frozen rows skip them too); ``focused`` / ``evicted``: masked
    rows kept / evicted, summed over steps; ``frozen``: frozen rows skipped, summed over steps."""

    forwards: int = 0
    rows_forwarded: int = 0
    rows_plain: int = 0
    rows_prefix: int = 0
    focused: int = 0
    evicted: int = 0
    frozen: int = 0
    decoded: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class FocusMemory:
    """One request's FOCUS state on the host.

    Across blocks: the decoding yield (Eqs. 17-19: tokens unmasked, steps). Per block (reset by
    :meth:`start_block`): which rows are masked, frozen (K/V cached, skipped) and pending (stable: frozen
    after the next forward), and ``reach``: rows ``[0, reach)`` have K/V at layers >= 2 (E.3.1's
    ``rightmost_processed`` + 1; placeholder integrity keeps them a prefix).
    """

    decoded_sum: int = 0
    steps: int = 0
    block: int = -1
    masked: list[bool] = field(default_factory=list)
    frozen: list[bool] = field(default_factory=list)
    pending: list[bool] = field(default_factory=list)
    reach: int = 0

    def start_block(self, block: int, masked: list[bool], delayed_cache: bool) -> None:
        self.block, self.masked, self.reach = block, list(masked), 0
        self.frozen = [False] * len(masked)
        self.pending = self._stable() if delayed_cache else [False] * len(masked)

    def _stable(self) -> list[bool]:
        m = self.masked
        n = len(m)
        return [not m[r] and (r + 1 == n or not m[r + 1]) and not self.frozen[r] for r in range(n)]

    def k_hist(self, alpha: float) -> int:
        """``ceil(alpha * Nbar)``, Nbar = 1 before the first step (Algorithm 1 lines 9-13)."""
        n_bar = 1.0 if self.steps == 0 else self.decoded_sum / self.steps
        return math.ceil(alpha * n_bar)

    def observe(self, picked: list[int], reach: int, delayed_cache: bool) -> None:
        """After the sampler: ``picked`` block rows were unmasked; the step's forward reached ``reach``."""
        self.reach = reach
        # The pending rows were forwarded (decoded, unfrozen: in the selection) by the step just taken.
        self.frozen = [f or p for f, p in zip(self.frozen, self.pending, strict=True)]
        for r in picked:
            self.masked[r] = False
        self.decoded_sum += len(picked)
        self.steps += 1
        if delayed_cache:
            self.pending = self._stable()
