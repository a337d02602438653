"""DyLLM's reference loop (``decode_service/policies/dyllm_base.py`` says what the method does and where the
paper says it): :class:`DyLLMLogits`, the SparseStep as the paper states it, row by row, over any method's
local rows and attention backend; its FullStep (:class:`DyLLMBase`: a plain forward that also caches every
layer's K/V, attention context and FFN output) uses per-layer projections written the way
``shared/model/transformer.py`` writes them, so that a step with every row salient computes exactly what
the plain forward computes. The decode worker's rounds (``decode_service/dyllm_rounds.py``) are held
to it token for token and counter for counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdllm.decode_service.policies.dyllm_base import DyLLMStats, context_cosine, step_kind
from pdllm.shared.decode_policy import PAPER_THRESHOLDS, DyLLMConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import AttentionBackend, DenseAttention
from pdllm.shared.model.transformer import DiffusionLM, SelfAttention, apply_rope
from tests.reference.policy import check_local_rows, run_policy, vanilla_local_rows

__all__ = [
    "PAPER_THRESHOLDS",
    "DyLLMConfig",
    "DyLLMLogits",
    "DyLLMStats",
    "denoise_with_dyllm",
    "step_kind",
    "vanilla_dyllm_logits",
]


def _ceil_count(value: float) -> int:
    """Rows a replayed share forces: ``value`` rounded up, after rounding away float noise below
    1e-6 (``0.7 * 10`` is 7 rows); written here, not imported, so the oracle shares no helper."""
    return math.ceil(round(value, 6))


@dataclass
class DyLLMCache:
    """Per layer, every local row's activations as of the last forward that touched them: ``keys`` and
    ``values`` ``[1, Hkv, N, D]`` (K after RoPE), ``contexts`` ``[N, Hq * D]`` (attention output before
    ``o_proj``), ``ffn`` ``[N, H]`` (MLP output)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    contexts: list[torch.Tensor]
    ffn: list[torch.Tensor]


def project_q(attn: SelfAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Queries ``[1, Hq, T, D]`` of the normed inputs ``h`` ``[1, T, H]`` (RoPE at ``cos``/``sin``)."""
    b, t, _ = h.shape
    q = attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    return apply_rope(q.transpose(1, 2), cos, sin)


def project_kv(
    attn: SelfAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (RoPE applied) and values ``[1, Hkv, T, D]`` of the normed inputs ``h`` ``[1, T, H]``."""
    b, t, _ = h.shape
    k = attn.k_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rope(k.transpose(1, 2), cos, sin), v


def flat(out: torch.Tensor) -> torch.Tensor:
    """An attention output ``[1, Hq, T, D]`` as token-major contexts ``[T, Hq * D]`` (``o_proj``'s input)."""
    return out[0].transpose(0, 1).reshape(out.shape[2], -1)


class DyLLMBase:
    """A sampler ``LogitsFn`` under DyLLM, with ``policy.PolicyLogits``'s constructor contract:
    ``local`` the local rows' tokens ``[N]`` (owned: the response part is overwritten every call),
    ``positions`` their position ids ``[1, N]``, ``response_start`` the local row of response token 0,
    ``inner`` the method's attention backend (vanilla: dense over the local rows; pdllm: the static chunk KV
    plus the local rows), called with queries of some local rows and K/V of every local row.

    Each call runs a FullStep or a SparseStep (:func:`step_kind`) and returns the logits of the masked
    positions ``at``; subclasses implement ``_sparse``. Batch 1; bidirectional models (Dream, LLaDA).
    """

    name = "dyllm"

    def __init__(
        self,
        model: DiffusionLM,
        local: torch.Tensor,
        positions: torch.Tensor,
        response_start: int,
        gen: GenerationConfig,
        config: DyLLMConfig,
        inner: AttentionBackend,
    ) -> None:
        check_local_rows(local, positions, response_start, gen)
        if model.config.block_size is not None:
            raise ValueError("DyLLM runs on bidirectional models (Dream, LLaDA), not block diffusion (SDAR)")
        config.validate()
        self.model, self.local, self.positions = model, local, positions
        self.response_start, self.gen, self.config, self.inner = response_start, gen, config, inner
        self.threshold = config.threshold_for(model.config.family)
        self.all_salient = self.threshold >= 1.0
        self.lead = 1 if model.config.shift_logits else 0
        self.cache: DyLLMCache | None = None
        self.previous: torch.Tensor | None = None  # the local tokens of the last forward
        self.stats = DyLLMStats()
        dtype = model.model.embed_tokens.weight.dtype
        self.cos, self.sin = model.model.rotary_emb(positions, dtype)  # positions never change

    def __call__(self, response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        self.local[self.response_start :] = response
        kind = step_kind(self.stats.forwards, self.config)
        if kind == "full":
            logits = self._full(at)
            self.stats.full_steps += 1
        else:
            first = 0 if kind == "sequence" else self.response_start - self.lead
            logits = self._sparse(at, first)
            self.stats.response_only_steps += int(kind == "response")
        if self.previous is None:
            self.previous = self.local.clone()
        else:
            self.previous.copy_(self.local)
        self.stats.forwards += 1
        self.stats.rows_total += self.local.shape[0] * len(self.model.model.layers)
        return logits

    def _sparse(self, at: torch.Tensor, first: int) -> torch.Tensor:
        """A SparseStep querying local rows ``[first, N)``; returns the logits at ``at``."""
        raise NotImplementedError

    def _full(self, at: torch.Tensor) -> torch.Tensor:
        """FullStep (App. C.2): the plain forward of every local row, keeping each layer's K/V, context
        and FFN output as the cache."""
        model, n = self.model, self.local.shape[0]
        x = model.model.embed_tokens(self.local[None])
        cache = DyLLMCache([], [], [], [])
        for layer in model.model.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = project_q(attn, h, self.cos, self.sin)
            k, v = project_kv(attn, h, self.cos, self.sin)
            context = flat(self.inner(attn.layer, q, k, v))
            x = x + attn.o_proj(context[None])
            ffn = layer.mlp(layer.post_attention_layernorm(x))
            x = x + ffn
            for store, value in zip(
                (cache.keys, cache.values, cache.contexts, cache.ffn), (k, v, context, ffn[0]), strict=True
            ):
                store.append(value)
        self.cache = cache
        layers = len(model.model.layers)
        self.stats.rows_forwarded += n * layers
        self.stats.kv_rows += n * layers
        return self._logits(x, at, 0)

    def _logits(self, x: torch.Tensor, at: torch.Tensor, first: int) -> torch.Tensor:
        """Logits at response positions ``at`` from the residual stream ``x`` of local rows ``[first, N)``."""
        hidden = self.model.model.norm(x)
        return self.model.logits_from_hidden(hidden, (at + (self.response_start - first))[None])[0]

    def first_salient(self, first: int) -> torch.Tensor:
        """The first layer's incoming salient rows as a mask over the queried rows ``[first, N)``: the rows
        whose token changed since the last forward (App. C.3: the tokens the last step unmasked; the others'
        embeddings, hence their first-layer K/V, are unchanged); every row when τ = 1."""
        if self.all_salient or self.previous is None:
            return torch.ones(self.local.shape[0] - first, dtype=torch.bool, device=self.local.device)
        return self.local[first:] != self.previous[first:]

    def summary(self) -> dict[str, int | str]:
        """The policy's name and counters (``GenerationResult.cache``)."""
        return {"policy": self.name, **self.stats.as_dict()}


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
            share = self.config.replay_ffn_frac  # a replayed share: the most drifted rows instead
            if share is not None:
                chosen = sorted(sorted(range(m), key=lambda i: (similarity[i], i))[: _ceil_count(share * m)])
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
