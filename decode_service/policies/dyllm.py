"""DyLLM (Lee et al., ``../shared/papers/dyllm.txt``): per layer, only the *salient* rows, whose attention
context moved since the previous step, run the FFN and refresh their K/V; the others reuse cached
activations and update their context approximately. The reference loop (this module); the decode worker's
rounds (``decode_service/dyllm_rounds.py``) are held to it token for token.

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
   the fused kernel instead reads only the salient columns of V. With ``approximate_attention`` off
   (Table 1's "Salient") those rows attend exactly too.
3. Saliency (§3.1-3.2): ``s = cos(C_t, C_{t-1})`` over all heads, for every row of Q; the layer's salient
   set is ``{s < τ}`` (τ = 1: every row). The cache takes ``C_t``.
4. ``x += o_proj(C_t)`` for all of Q; the FFN runs on the salient rows only and refreshes their cached
   ``F``; every row of Q adds its (new or cached) ``F`` (§3.2: stable rows skip the FFN).
5. The layer's salient set is the next layer's S (its rows' K/V and exact contexts are recomputed there).

The logits come from the final norm of the queried rows. Knobs and defaults: :class:`DyLLMConfig`
(τ: 0.995 Dream, 0.99 LLaDA, §4.2.3). Composition: ``inner`` is the method's backend (pdllm's static KV,
``decode_service.decode.static_policy_logits``); DyLLM decides only about the local rows.

**Exact identities** (tested): τ = 1 with ``full_sequence_interval`` 1 computes every row of every layer
on every step, i.e. plain decoding; a forward whose tokens did not change computes no row and reproduces the
previous logits.
"""

from __future__ import annotations

import torch

from pdllm.shared.decode_policy import PAPER_THRESHOLDS, DyLLMConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import AttentionBackend, DenseAttention
from pdllm.shared.model.transformer import DiffusionLM

from .base import vanilla_local_rows
from .dyllm_base import (
    DyLLMBase,
    DyLLMStats,
    context_cosine,
    flat,
    project_kv,
    project_q,
    step_kind,
)
from .runner import run_policy

__all__ = [
    "PAPER_THRESHOLDS",
    "DyLLMConfig",
    "DyLLMLogits",
    "DyLLMStats",
    "denoise_with_dyllm",
    "step_kind",
    "vanilla_dyllm_logits",
]


class DyLLMLogits(DyLLMBase):
    """DyLLM's reference path: the SparseStep as the paper states it, row by row (salient rows as Python
    lists read from the host, K/V and FFN outputs written into the caches one row at a time)."""

    def _sparse(self, at: torch.Tensor, first: int) -> torch.Tensor:
        cache, model = self.cache, self.model
        assert cache is not None, "a SparseStep follows at least one FullStep"
        device, m = self.local.device, self.local.shape[0] - first
        x = model.model.embed_tokens(self.local[None, first:])
        cos, sin = self.cos[:, first:], self.sin[:, first:]
        # Query-row indices (local row = first + i) of the incoming salient rows.
        salient = self.first_salient(first).nonzero().flatten().tolist()
        for layer in model.model.layers:
            attn = layer.self_attn
            li = attn.layer
            h = layer.input_layernorm(x)
            q = project_q(attn, h, cos, sin)
            # 1. K/V: fresh for the salient rows, cached for every other local row.
            old_k, old_v = cache.keys[li], cache.values[li]
            keys, values = old_k.clone(), old_v.clone()
            if salient:
                rows = torch.tensor(salient, device=device)
                k, v = project_kv(attn, h[:, rows], cos[:, rows], sin[:, rows])
                for j, i in enumerate(salient):
                    keys[:, :, first + i] = k[:, :, j]
                    values[:, :, first + i] = v[:, :, j]
            # 2. Contexts: exact rows over the merged K/V; the others C_{t-1} + A_t (V_t - V_{t-1}).
            exact = flat(self.inner(li, q, keys, values))
            before = cache.contexts[li][first:]
            if self.config.approximate_attention:
                context = before + (exact - flat(self.inner(li, q, keys, old_v)))
                for i in salient:
                    context[i] = exact[i]
            else:
                context = exact.clone()
            # 3. This layer's salient rows: the context turned by more than τ allows.
            similarity = context_cosine(context, before).tolist()
            chosen = [i for i, s in enumerate(similarity) if self.all_salient or s < self.threshold]
            contexts = cache.contexts[li].clone()
            for i in range(m):
                contexts[first + i] = context[i]
            # 4. Attention output for every queried row; the FFN for the chosen rows only.
            x = x + attn.o_proj(context[None])
            ffn = cache.ffn[li].clone()
            if chosen:
                rows = torch.tensor(chosen, device=device)
                out = layer.mlp(layer.post_attention_layernorm(x[:, rows]))
                for j, i in enumerate(chosen):
                    ffn[first + i] = out[0, j]
            x = x + ffn[first:][None]
            cache.keys[li], cache.values[li], cache.contexts[li], cache.ffn[li] = keys, values, contexts, ffn
            self.stats.kv_rows += len(salient)
            self.stats.rows_forwarded += len(chosen)
            salient = chosen  # 5.
        return self._logits(x, at, first)


def vanilla_dyllm_logits(
    model: DiffusionLM,
    prompt: torch.Tensor,
    gen: GenerationConfig,
    config: DyLLMConfig,
) -> DyLLMBase:
    """DyLLM on the vanilla path: local rows prompt + response, dense attention over them."""
    local, positions = vanilla_local_rows(model.config.mask_token_id, prompt, gen)
    return DyLLMLogits(model, local, positions, prompt.numel(), gen, config, DenseAttention())


@torch.inference_mode()
def denoise_with_dyllm(
    model: DiffusionLM,
    local: torch.Tensor,
    positions: torch.Tensor,
    response_start: int,
    gen: GenerationConfig,
    config: DyLLMConfig,
    inner: AttentionBackend,
    progress: bool = False,
) -> GenerationResult:
    """:func:`denoise` under DyLLM's reference loop over the local rows."""
    gen.validate()
    return run_policy(DyLLMLogits(model, local, positions, response_start, gen, config, inner), progress)
