"""Model configuration: one dataclass for every dLLM family, mapped from Hugging Face configs.

Dream checkpoints use the Qwen2 layout (q/k/v bias, shifted logits); LLaDA checkpoints use the LLaMA
layout (no bias, unshifted logits); SDAR checkpoints (block diffusion) use the Qwen3 layout (per-head
q/k RMSNorm, unshifted logits) and attend block-causally. All are described by :class:`ModelConfig`; the
family only decides the defaults that differ (logit shift, mask id, bias, q/k norm, block size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["dream", "llada", "sdar"]
FAMILIES: tuple[str, ...] = ("dream", "llada", "sdar")

LLADA_MASK_ID = 126336
DREAM_MASK_ID = 151666
SDAR_MASK_ID = 151669  # <|MASK|> in SDAR's Qwen3 tokenizer (its config.json names it as well)
# SDAR's config.json calls its block size ``block_size`` (the training block: 4 in the released SDAR chat
# checkpoints). A Qwen3 config without one (e.g. transformers' own Qwen3 save) gets this default.
SDAR_DEFAULT_BLOCK_SIZE = 4


class ModelConfigError(ValueError):
    """A checkpoint's configuration cannot be served (unknown architecture, missing field, ...)."""


@dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Hugging Face rope scaling dict ({"rope_type": "yarn", "factor": 4.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # Qwen3/SDAR: o_proj has a bias exactly when q/k/v do (Qwen2/LLaMA never have one there).
    output_bias: bool = False
    # Qwen3/SDAR: RMSNorm over each head's q and k (one weight of head_dim per layer) before RoPE.
    qk_norm: bool = False
    # Block diffusion (SDAR): token i sees token j iff position(j) // block_size <= position(i) // block_size.
    # None: the family attends bidirectionally (Dream, LLaDA).
    block_size: int | None = None
    tie_word_embeddings: bool = False
    # Dream predicts token i from the hidden state at i-1; LLaDA predicts it from i.
    shift_logits: bool = False
    mask_token_id: int = LLADA_MASK_ID
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Free-form identity used in KV cache keys (name + revision); never affects the math.
    model_id: str = "unnamed"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelConfigError(
                f"unknown model family {self.family!r} (expected one of {', '.join(FAMILIES)})"
            )
        if (self.family == "sdar") != (self.block_size is not None):
            raise ModelConfigError(
                f"block_size={self.block_size} with family {self.family!r}: only SDAR has one"
            )
        if self.block_size is not None and self.block_size <= 0:
            raise ModelConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face mapping
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], model_id: str = "unnamed") -> ModelConfig:
        """Map a ``config.json`` dict (Qwen2, Dream, LLaMA, LLaDA, Qwen3 or SDAR) onto a ModelConfig."""
        model_type = str(cfg.get("model_type", "")).lower()
        archs = [a.lower() for a in cfg.get("architectures") or []]
        # model_type decides the field names; architectures only disambiguate an unknown model_type.
        if model_type in ("dream", "qwen2"):
            return cls._from_qwen2_like(cfg, model_id)
        if model_type == "llama":
            return cls._from_llama(cfg, model_id)
        # A plain Qwen3 config is read as SDAR (same layout and names): SDAR is a Qwen3 continually
        # pre-trained for block diffusion, and transformers' Qwen3 is the reference its forward is held to.
        if model_type in ("sdar", "qwen3") or any("sdar" in a for a in archs):
            return cls._from_qwen3_like(cfg, model_id)
        if model_type == "llada" or any("llada" in a for a in archs):
            return cls._from_llada(cfg, model_id)
        if any("dream" in a for a in archs):
            return cls._from_qwen2_like(cfg, model_id)
        raise ModelConfigError(
            f"unknown architecture model_type={cfg.get('model_type')!r} architectures={cfg.get('architectures')}"
            " (supported: Dream/Qwen2, LLaDA/LLaMA, SDAR/Qwen3)"
        )

    @classmethod
    def _from_qwen2_like(cls, cfg: dict[str, Any], model_id: str) -> ModelConfig:
        return cls(
            family="dream",
            **_hf_shape(cfg, max_positions=4096),
            attention_bias=True,
            shift_logits=True,
            mask_token_id=cfg.get("mask_token_id", DREAM_MASK_ID),
            **_token_ids(cfg, model_id),
        )

    @classmethod
    def _from_qwen3_like(cls, cfg: dict[str, Any], model_id: str) -> ModelConfig:
        layer_types = set(cfg.get("layer_types") or ["full_attention"])
        if cfg.get("use_sliding_window") or layer_types != {"full_attention"}:
            # SDAR checkpoints attend fully within the block-causal mask; a window would change the math.
            raise ModelConfigError(
                "sliding-window attention (use_sliding_window / layer_types) is not supported"
            )
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            family="sdar",
            **_hf_shape(cfg, max_positions=32768),
            attention_bias=bias,
            output_bias=bias,
            qk_norm=True,
            block_size=int(cfg.get("block_size") or SDAR_DEFAULT_BLOCK_SIZE),
            shift_logits=False,  # SDAR's loss scores each masked position's own hidden state
            mask_token_id=cfg.get("mask_token_id", SDAR_MASK_ID),
            **_token_ids(cfg, model_id),
        )

    @classmethod
    def _from_llama(cls, cfg: dict[str, Any], model_id: str) -> ModelConfig:
        return cls(
            family="llada",
            **_hf_shape(cfg, max_positions=4096),
            attention_bias=bool(cfg.get("attention_bias", False)),
            shift_logits=False,
            mask_token_id=cfg.get("mask_token_id", LLADA_MASK_ID),
            **_token_ids(cfg, model_id),
        )

    @classmethod
    def _from_llada(cls, cfg: dict[str, Any], model_id: str) -> ModelConfig:
        heads = _require(cfg, "n_heads")
        hidden = _require(cfg, "d_model")
        theta, scaling = _rope(cfg)
        return cls(
            family="llada",
            vocab_size=cfg.get("embedding_size") or _require(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require(cfg, "mlp_hidden_size"),
            num_layers=_require(cfg, "n_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("n_kv_heads") or heads,
            head_dim=hidden // heads,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_sequence_length", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            attention_bias=bool(cfg.get("include_qkv_bias", cfg.get("include_bias", False))),
            tie_word_embeddings=bool(cfg.get("weight_tying", False)),
            shift_logits=False,
            mask_token_id=cfg.get("mask_token_id", LLADA_MASK_ID),
            **_token_ids(cfg, model_id),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config this model is equivalent to (Qwen2 for Dream, LLaMA for LLaDA, SDAR's
        Qwen3-based config for SDAR)."""
        common = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mask_token_id": self.mask_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            common["rope_scaling"] = dict(self.rope_scaling)
        if self.family == "dream":
            return {"model_type": "Dream", "architectures": ["DreamModel"], **common}
        if self.family == "sdar":
            sdar = {
                "attention_bias": self.attention_bias,
                "block_size": self.block_size,
                "use_sliding_window": False,
            }
            return {"model_type": "sdar", "architectures": ["SDARForCausalLM"], **sdar, **common}
        return {"model_type": "llama", "architectures": ["LLaDAModelLM"], "attention_bias": False, **common}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"config.json is missing required field {key!r}")
    return cfg[key]


def _first(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read rope theta/scaling from either the transformers-4 or the transformers-5 spelling."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _hf_shape(cfg: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """The ModelConfig fields that Qwen2/Dream, Qwen3/SDAR and LLaMA configs name alike."""
    heads = _require(cfg, "num_attention_heads")
    hidden = _require(cfg, "hidden_size")
    theta, scaling = _rope(cfg)
    return {
        "vocab_size": _require(cfg, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": _require(cfg, "intermediate_size"),
        "num_layers": _require(cfg, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or hidden // heads,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings", max_positions),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def _token_ids(cfg: dict[str, Any], model_id: str) -> dict[str, Any]:
    return {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": _first(cfg.get("eos_token_id")),
        "pad_token_id": cfg.get("pad_token_id"),
        "model_id": model_id,
    }
