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
   the fused kernel instead reads only the salient columns of V. With ``approximate_attention`` off
   (Table 1's "Salient") those rows attend exactly too.
3. Saliency (§3.1-3.2): ``s = cos(C_t, C_{t-1})`` over all heads, for every row of Q; the layer's salient
   set is ``{s < τ}`` (τ = 1: every row). The cache takes ``C_t``.
4. ``x += o_proj(C_t)`` for all of Q; the FFN runs on the salient rows only and refreshes their cached
   ``F``; every row of Q adds its (new or cached) ``F`` (§3.2: stable rows skip the FFN).
5. The layer's salient set is the next layer's S (its rows' K/V and exact contexts are recomputed there).

The logits come from the final norm of the queried rows. Knobs and defaults: :class:`DyLLMConfig`
(τ: 0.995 Dream, 0.99 LLaDA, §4.2.3). Composition: ``inner`` is the method's backend (pdllm's static KV,
``decode_service/decode.py``'s static-KV attention); DyLLM decides only about the local rows.

**Exact identities** (tested): τ = 1 with ``full_sequence_interval`` 1 computes every row of every layer
on every step, i.e. plain decoding; a forward whose tokens did not change computes no row and reproduces the
previous logits.

**This module**: which kind a step is (:func:`step_kind`), the per-layer activation cache, the counters,
the FullStep (a plain forward that also caches every layer's K/V, attention context and FFN output) and
the per-layer projections written the way ``shared/model/transformer.py`` writes them, so that a step with
every row salient computes exactly what the plain forward computes. The knobs, :class:`DyLLMConfig`, are
``shared/decode_policy.py``'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pdllm.shared.decode_policy import DyLLMConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM, SelfAttention, apply_rope

from .base import check_local_rows


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


def context_cosine(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per row, the cosine similarity of two ``[T, Hq * D]`` contexts over all heads, in float32, with the
    released kernel's guard against zero norms (§3.1's temporal cosine similarity)."""
    a, b = new.float(), old.float()
    dot, na, nb = (a * b).sum(-1), (a * a).sum(-1), (b * b).sum(-1)
    return dot * torch.rsqrt(na.clamp_min(1e-8)) * torch.rsqrt(nb.clamp_min(1e-8))


class DyLLMBase:
    """A sampler ``LogitsFn`` under DyLLM, with ``PolicyLogits``'s constructor contract (``tests/reference``):
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
