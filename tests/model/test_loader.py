"""Checkpoint loading: native LLaDA/Dream configs and names, sharded files, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pdllm.shared.model.config import LLADA_MASK_ID
from pdllm.shared.model.loader import CheckpointError, load_model, save_checkpoint

from .helpers import tiny_model

LLADA_NAMES = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
}
LLADA_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}


def _to_llada_name(name: str) -> str:
    if name in LLADA_NAMES:
        return LLADA_NAMES[name]
    _, _, idx, rest = name.split(".", 3)
    for ours, theirs in LLADA_LAYER.items():
        if rest.startswith(ours + "."):
            return f"model.transformer.blocks.{idx}.{theirs}{rest[len(ours) :]}"
    raise AssertionError(name)


def test_native_llada_checkpoint(tmp_path) -> None:
    ours = tiny_model("llada", mask_token_id=LLADA_MASK_ID, vocab_size=LLADA_MASK_ID + 1)
    c = ours.config
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llada",
                "architectures": ["LLaDAModelLM"],
                "d_model": c.hidden_size,
                "n_heads": c.num_heads,
                "n_kv_heads": c.num_kv_heads,
                "n_layers": c.num_layers,
                "mlp_hidden_size": c.intermediate_size,
                "vocab_size": c.vocab_size,
                "embedding_size": c.vocab_size,
                "rope_theta": c.rope_theta,
                "rms_norm_eps": c.rms_norm_eps,
                "include_bias": False,
                "weight_tying": False,
                "max_sequence_length": 512,
            }
        )
    )
    state = {_to_llada_name(k): v for k, v in ours.state_dict().items()}
    # Two shards with an index, as large checkpoints are stored.
    keys = sorted(state)
    half = len(keys) // 2
    save_file({k: state[k] for k in keys[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(tmp_path, load_tokenizer=False)
    assert loaded.config.family == "llada" and not loaded.config.shift_logits
    assert loaded.config.mask_token_id == LLADA_MASK_ID
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids), ours(ids), atol=1e-6)


def test_bf16_load(tmp_path) -> None:
    save_checkpoint(tiny_model("dream"), tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16", load_tokenizer=False)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    with torch.no_grad():
        out = loaded.model(torch.tensor([[1, 5, 9]]))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_missing_directory() -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model("/nonexistent/model")


def test_missing_config(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)


def test_unknown_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(CheckpointError, match="unknown architecture.*gpt2"):
        load_model(tmp_path)


def test_missing_weights(tmp_path) -> None:
    save_checkpoint(tiny_model("dream"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_mismatched_shape_names_file_and_parameter(tmp_path) -> None:
    save_checkpoint(tiny_model("dream"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: parameter 'model\.layers\.0\.mlp"):
        load_model(tmp_path)


def test_corrupt_weights_file(tmp_path) -> None:
    save_checkpoint(tiny_model("dream"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(tmp_path)
