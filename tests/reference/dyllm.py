"""DyLLM's reference loop (``decode_service/policies/dyllm_base.py`` says what the method does and where the
paper says it): :class:`DyLLMLogits`, the SparseStep as the paper states it, row by row, over any method's
local rows and attention backend. The decode worker's rounds (``decode_service/dyllm_rounds.py``) are held
to it token for token and counter for counter.
"""

from __future__ import annotations

import torch

from pdllm.decode_service.policies.base import vanilla_local_rows
from pdllm.decode_service.policies.dyllm_base import (
    DyLLMBase,
    DyLLMStats,
    context_cosine,
    flat,
    project_kv,
    project_q,
    step_kind,
)
from pdllm.shared.decode_policy import PAPER_THRESHOLDS, DyLLMConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import AttentionBackend, DenseAttention
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.policy import run_policy

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
