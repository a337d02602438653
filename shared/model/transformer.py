"""The dLLM transformer (Qwen2 layout for Dream, LLaMA for LLaDA, Qwen3 for SDAR), with explicit everything.

Parameter names follow Hugging Face's ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``
so checkpoints load without renaming. The forward takes explicit position ids and an explicit attention
backend (see ``attention.py``); it never owns a cache, which is what lets chunked prefill, scoring and
sparse decode reuse it unchanged.

Inference on CUDA takes a fused route (:func:`fused_route`): RMSNorm (+ residual add), RoPE and SiLU*up
as single Triton kernels from ``pdllm.kernels`` and, after :meth:`DiffusionLM.pack_projections`, one GEMM
for q/k/v and one for gate/up. The eager torch ops stay the definition (CPU, training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdllm.kernels import HAS_TRITON
from pdllm.kernels.resources import smem_limit
from pdllm.kernels.rms_norm import rms_norm
from pdllm.kernels.rope import apply_rope as apply_rope_fused
from pdllm.kernels.rope import rotate_half
from pdllm.kernels.silu_mul import silu_mul_fused
from pdllm.kernels.skinny_gemm import pick_config, skinny_linear, skinny_silu_mul
from pdllm.shared.stepwise import Steps, drain

from .attention import AttentionBackend, DenseAttention
from .config import ModelConfig, ModelConfigError
from .sdar import BlockCausalAttention


def fused_route(module: nn.Module, x: torch.Tensor) -> bool:
    """Use the fused Triton kernels: CUDA inference only (they have no backward; CPU keeps the torch ops),
    unless :meth:`DiffusionLM.set_fused` turned them off."""
    return module.fused and HAS_TRITON and x.is_cuda and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.fused = True
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_route(self, x):
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Packed:
    """Several ``nn.Linear`` on the same input as one GEMM over a concatenated weight (inference only).

    The linears' parameters become frozen views into the packed tensor, so memory does not grow and
    ``state_dict`` keeps its names; pack after the model is on its final device and dtype.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("cannot pack linears where only some have a bias")
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        start = 0
        for lin, size in zip(linears, self.sizes, strict=True):
            lin.weight = nn.Parameter(self.weight[start : start + size], requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[start : start + size], requires_grad=False)
            start += size

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


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
    # Explicitly on CPU: the loader builds the model under ``torch.device("meta")``, where transformers'
    # init functions would make meta tensors and then fail to copy them to the CPU.
    with torch.device("cpu"):
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


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
        self.o_proj = nn.Linear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.output_bias
        )
        # Qwen3/SDAR normalise each head's q and k (RMSNorm over head_dim) before RoPE.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.fused = True
        self.qkv: Packed | None = None  # set by pack_projections

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(attention(self.layer, q, k, v))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, T, D]`` (RoPE applied), k, v ``[B, Hkv, T, D]`` of ``x`` ``[B, T, H]``."""
        b, t, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if fused_route(self, x):
            # expand: callers may pass one row of positions for a whole batch (eager broadcasts it)
            q, k = apply_rope_fused(q, k, cos.expand(b, -1, -1), sin.expand(b, -1, -1))
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of attention's ``out`` ``[B, Hq, T, D]``."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused = True
        self.gate_up: Packed | None = None  # set by pack_projections

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``, plus ``residual`` when given (the decoder layer's skip)."""
        if self.gate_up is not None and fused_route(self, x):
            out = self._skinny(x, residual)
            if out is not None:
                return out
            out = self.down_proj(silu_mul_fused(self.gate_up.linear(x)))
        elif self.gate_up is not None:
            gate, up = self.gate_up(x)
            out = self.down_proj(F.silu(gate) * up)
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if residual is None else residual + out

    def _skinny(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """A decode step's few rows: SwiGLU in the gate/up GEMM's epilogue and the skip in down's
        (``kernels/skinny_gemm.py``); None where those kernels have no config (cuBLAS then)."""
        rows = x.reshape(-1, x.shape[-1])
        w_gu, w_down = self.gate_up.weight, self.down_proj.weight
        smem = smem_limit(rows.device)  # configs are fitted per dtype to the device's shared memory
        glu = pick_config(rows.shape[0], w_gu.shape[0] // 2, rows.shape[1], True, rows.dtype, smem)
        usable = rows.is_contiguous() and rows.dtype == w_gu.dtype == w_down.dtype
        if glu is None or not usable or w_gu.stride(1) != 1 or w_down.stride(1) != 1:
            return None
        h = skinny_silu_mul(rows, w_gu, glu)
        down = pick_config(h.shape[0], w_down.shape[0], h.shape[1], False, h.dtype, smem)
        res = None if residual is None else residual.reshape(-1, residual.shape[-1])
        if down is None:
            out = F.linear(h, w_down)
            out = out if res is None else res + out
        else:
            out = skinny_linear(h, w_down, residual=res, config=down)
        return out.view(*x.shape[:-1], out.shape[-1])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.fused = True

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        out = attention(self.self_attn.layer, *self.attention_inputs(x, cos, sin))
        edit_ffn = getattr(attention, "edit_ffn", None)
        if edit_ffn is not None:  # a decode policy replaces some rows' FFN output (DyLLM's cached ones)
            x, ffn = self.ffn_of(x, out)
            return x + edit_ffn(self.self_attn.layer, ffn)
        return self.after_attention(x, out)

    def attention_inputs(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's work before attention: its q, k, v of ``x``."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's work after attention (``out``): its output."""
        attn = self.self_attn.output(out)
        if fused_route(self, x):  # residual add and the second norm in one pass over the activations
            norm = self.post_attention_layernorm
            h, x = rms_norm(attn, norm.weight, norm.eps, residual=x)
            return self.mlp(h, residual=x)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def ffn_of(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention, split before the residual add of the FFN: ``x`` + attention, and the FFN output."""
        x = x + self.self_attn.output(out)
        return x, self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class DiffusionLM(nn.Module):
    """A masked-diffusion LM: transformer + LM head, logits aligned to token positions. Attention is the
    caller's backend; by default bidirectional (Dream, LLaDA) or block-causal (SDAR: ``block_size``)."""

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

    def set_fused(self, enabled: bool) -> None:
        """Turn the fused CUDA kernels on (default) or off (the eager torch ops, e.g. to measure them)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, SelfAttention, MLP, DecoderLayer)):
                module.fused = enabled

    def pack_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer (fewer, larger kernels: a decode step of a
        7B model runs at M ~ 56 rows, where each launch counts). Inference only; idempotent."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv is None:
                attn.qkv = Packed([attn.q_proj, attn.k_proj, attn.v_proj])
            if mlp.gate_up is None:
                mlp.gate_up = Packed([mlp.gate_proj, mlp.up_proj])

    def embed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer-0 input ``[B, T, H]`` of ``input_ids`` and the RoPE tables of ``position_ids`` ``[B, T]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        return x, cos, sin

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, H]``. Default attention: the family's (see the class)."""
        return drain(self.hidden_states_steps(input_ids, position_ids, attention))

    def hidden_states_steps(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
        layers_per_step: int | None = None,
    ) -> Steps[torch.Tensor]:
        """:meth:`hidden_states` in pieces of ``layers_per_step`` layers (None: one piece), so a long forward
        can run between other device work (the decode scheduler's builds)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if layers_per_step is not None and layers_per_step <= 0:
            raise ValueError(f"layers_per_step must be positive, got {layers_per_step}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if attention is None:
            block = self.config.block_size
            attention = DenseAttention() if block is None else BlockCausalAttention(position_ids, block)
        x, cos, sin = self.embed(input_ids, position_ids)
        for i, layer in enumerate(self.model.layers):
            if layers_per_step is not None and i and i % layers_per_step == 0:
                yield
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
