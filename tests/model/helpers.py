"""Tiny random models shared by the model and generation tests."""

from __future__ import annotations

from pdllm.shared.model.config import ModelConfig
from pdllm.shared.model.transformer import DiffusionLM


def tiny_config(family: str = "dream", **overrides) -> ModelConfig:
    base = dict(
        family=family,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        attention_bias=family == "dream",
        shift_logits=family == "dream",
        qk_norm=family == "sdar",
        block_size=4 if family == "sdar" else None,
        mask_token_id=96,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(family: str = "dream", seed: int = 0, **overrides) -> DiffusionLM:
    model = DiffusionLM(tiny_config(family, **overrides))
    model.init_weights(seed, std=0.2)
    return model.eval()
