"""The dLLM transformer (Qwen2 layout for Dream, LLaMA layout for LLaDA), with explicit everything.

Parameter names follow Hugging Face's ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` so checkpoints load
without renaming. The forward takes explicit position ids and an explicit attention backend (see
``attention.py``); it never owns a cache, which is what lets chunked prefill, scoring and sparse decode
reuse it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend, DenseAttention
from .config import ModelConfig, ModelConfigError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE frequencies from the config; scaled variants (yarn, linear, llama3, ...) via transformers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    scaling = config.rope_scaling
    if not scaling:
        exponent = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        return 1.0 / (config.rope_theta**exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = scaling.get("rope_type", "default")
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelConfigError(
            f"rope_scaling type {rope_type!r} is not supported (static types: "
            f"{sorted(k for k in ROPE_INIT_FUNCTIONS if k != 'dynamic')})"
        )
    rope_kwargs: dict = {"rope_theta": config.rope_theta, "rope_scaling": dict(scaling)}
    if hasattr(LlamaConfig(), "rope_parameters"):  # transformers >= 5 spelling
        rope_kwargs = {"rope_parameters": {**scaling, "rope_theta": config.rope_theta}}
    hf = LlamaConfig(
        hidden_size=config.num_heads * config.head_dim,
        num_attention_heads=config.num_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        **rope_kwargs,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.layer, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class DiffusionLM(nn.Module):
    """A masked-diffusion LM: bidirectional transformer + LM head, logits aligned to token positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic random init (tests and training from scratch)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, H]``. Default attention: full bidirectional."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        attention = attention if attention is not None else DenseAttention()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def logits_from_hidden(self, hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits predicting the tokens at ``positions`` (``[B, n]`` indices into the forward's tokens).

        Dream's logits are shifted: the token at i is predicted from the hidden state at i-1 (and
        position 0 from itself, as Dream does). Computing the LM head only where needed matters: the
        vocabulary is 126K-152K for the real models.
        """
        if self.config.shift_logits:
            src = (
                torch.arange(hidden.shape[1], device=hidden.device)[None].expand(hidden.shape[0], -1)
                if positions is None
                else positions
            )
            src = (src - 1).clamp_min(0)
            positions = src
        if positions is not None:
            hidden = torch.gather(hidden, 1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T or n, V]`` aligned so that row i predicts token ``logits_at[i]`` (or i)."""
        hidden = self.hidden_states(input_ids, position_ids, attention)
        return self.logits_from_hidden(hidden, logits_at)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
