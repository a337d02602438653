"""DyLLM (Lee et al., ``../shared/papers/dyllm.txt``): per layer, only the *salient* rows, whose attention
context moved since the previous step, run the FFN and refresh their K/V; the others reuse cached
activations and update their context approximately. The decode worker runs it in its batched rounds
(``decode_service/dyllm_rounds.py``), held token for token to the reference loop
(``tests/reference/dyllm.py``: the SparseStep below, row by row).

The paper's text lost its formulas; where it is silent the released code (scale-snu/DyLLM: ``Attention``,
``LLaDAAttention``, ``MLPcache``, ``model_runner.prepare_sparse``, the ``attention_sparse_varlen`` kernel)
decides, and the docstrings say so.

**Steps** (App. C.1). The decode's first ``full_steps`` forwards (§3.2: 4) are *FullSteps*: a plain
forward of every local row that caches, per layer, K/V (after RoPE), the attention context ``C`` (before
``o_proj``) and the FFN output ``F`` (App. C.2). Every later forward is a *SparseStep*. Response-only steps
(§3.5): a SparseStep queries every local row on every ``full_sequence_interval``-th forward (4), else the
response only (plus, on Dream, the row before it, whose hidden state predicts the first response token);
rows not queried keep all their cached activations.

**SparseStep, layer l** (App. C.3, §3.2-3.3), queried rows Q, incoming salient rows S ⊆ Q (layer 0: the
rows whose token changed since the last forward, App. C.3; layer l > 0: the rows layer l - 1 selected):

1. ``h = norm(x)`` for Q; queries of every row in Q; K/V recomputed for S only; every other local row
   keeps its cached K/V. ``ΔV`` = the salient rows' new minus cached values (zero elsewhere).
2. Contexts (eq. 3, ``ΔC = A_t ΔV + (A_t - A_{t-1}) V_{t-1}``): salient path, rows in S attend exactly
   (``softmax(q K^T) V`` over the merged K/V; under pdllm also the static chunk KV, through ``inner``);
   non-salient path, the other rows of Q keep their routing (``A_t ≈ A_{t-1}``) and take
   ``C_t = C_{t-1} + A_t ΔV``: only the salient columns of A contribute. As in the released kernel, ``A_t``
   is this step's softmax row over every key (static + local). Through an opaque backend ``inner`` this is
   computed by linearity as ``inner(q, K, V_t) - inner(q, K, V_{t-1})``, so the static KV's share cancels;
   the rounds instead sum over the salient columns only (``kernels/salient_attention.py``). With ``approximate_attention`` off
   (Table 1's "Salient") those rows attend exactly too.
3. Saliency (§3.1-3.2): ``s = cos(C_t, C_{t-1})`` over all heads, for every row of Q; the layer's salient
   set is ``{s < τ}`` (τ = 1: every row). The cache takes ``C_t``.
4. ``x += o_proj(C_t)`` for all of Q; the FFN runs on the salient rows only and refreshes their cached
   ``F``; every row of Q adds its (new or cached) ``F`` (§3.2: stable rows skip the FFN).
5. The layer's salient set is the next layer's S (its rows' K/V and exact contexts are recomputed there).

The logits come from the final norm of the queried rows. Knobs and defaults: :class:`DyLLMConfig`
(τ: 0.995 Dream, 0.99 LLaDA, §4.2.3). Composition: ``inner`` is the method's backend (pdllm's static KV,
read through the method's attention); DyLLM decides only about the local rows.

**Exact identities** (tested): τ = 1 with ``full_sequence_interval`` 1 computes every row of every layer
on every step, i.e. plain decoding; a forward whose tokens did not change computes no row and reproduces the
previous logits.

**This module**: what the rounds and the reference loop share: which kind a step is (:func:`step_kind`),
the counters (:class:`DyLLMStats`) and the saliency measure (:func:`context_cosine`). The knobs,
:class:`DyLLMConfig`, are ``shared/decode_policy.py``'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pdllm.shared.decode_policy import DyLLMConfig


def step_kind(step: int, config: DyLLMConfig) -> str:
    """``"full"`` (FullStep), ``"sequence"`` (a SparseStep querying every local row) or ``"response"`` (a
    SparseStep querying the response only) for the decode's ``step``-th forward (0: the first). The full
    sequence is queried on forwards ``step + 1`` divisible by the interval, as the released code counts."""
    if step < config.full_steps:
        return "full"
    return "sequence" if (step + 1) % config.full_sequence_interval == 0 else "response"


@dataclass
class DyLLMStats:
    """What DyLLM computed. ``rows_forwarded``: rows that ran the FFN, summed over layers (a FullStep: every
    local row); ``kv_rows``: rows whose K/V were recomputed and whose context was attended exactly, summed
    over layers; ``rows_total``: local rows x layers over all forwards (what plain decoding computes)."""

    forwards: int = 0
    full_steps: int = 0
    response_only_steps: int = 0
    rows_forwarded: int = 0
    kv_rows: int = 0
    rows_total: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def context_cosine(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per row, the cosine similarity of two ``[T, Hq * D]`` contexts over all heads, in float32, with the
    released kernel's guard against zero norms (§3.1's temporal cosine similarity)."""
    a, b = new.float(), old.float()
    dot, na, nb = (a * b).sum(-1), (a * a).sum(-1), (b * b).sum(-1)
    return dot * torch.rsqrt(na.clamp_min(1e-8)) * torch.rsqrt(nb.clamp_min(1e-8))
