"""Our runtime's logits equal transformers' Qwen2/Llama run with a full (non-causal) attention mask."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.model.loader import load_model, save_checkpoint
from pdllm.shared.model.transformer import DiffusionLM

from .helpers import tiny_model

ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
]


def _hf_model(ours: DiffusionLM, attn_impl: str = "eager") -> torch.nn.Module:
    cfg = ours.config.to_hf_dict()
    for key in ("model_type", "architectures", "mask_token_id"):
        cfg.pop(key)
    if ours.config.family == "dream":
        hf = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation=attn_impl))
    else:
        hf = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attn_impl))
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    full = torch.zeros(ids.shape[0], 1, ids.shape[1], ids.shape[1])  # additive: everything visible
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=full).logits


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rope", ROPE_CASES, ids=["default", "linear", "yarn"])
def test_logits_match_transformers(family: str, kv_heads: int, rope: dict | None) -> None:
    ours = tiny_model(family, num_kv_heads=kv_heads, rope_scaling=rope)
    hf = _hf_model(ours)
    ids = torch.randint(0, ours.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    ref = _hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    if family == "dream":
        # Dream predicts token i from hidden i-1 (position 0 from itself).
        ref = torch.cat([ref[:, :1], ref[:, :-1]], dim=1)
    assert (got - ref).abs().max().item() <= 1e-4


def test_causal_mode_matches_transformers_causal() -> None:
    ours = tiny_model("llada")
    hf = _hf_model(ours)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits  # transformers' default for Llama is causal
        got = ours(ids, attention=DenseAttention(causal=True))
    assert (got - ref).abs().max().item() <= 1e-4


def test_logits_at_selects_rows() -> None:
    ours = tiny_model("dream")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = ours(ids)
        at = torch.tensor([[0, 5, 11], [3, 3, 7]])
        part = ours(ids, logits_at=at)
    expected = torch.stack([full[b, at[b]] for b in range(2)])
    assert torch.allclose(part, expected, atol=1e-6)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_save_pretrained_checkpoint_reproduces_logits(tmp_path, family: str) -> None:
    ours = tiny_model(family, num_kv_heads=2)
    hf = _hf_model(ours)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    # transformers writes model_type qwen2/llama: the loader maps both onto our families.
    loaded = load_model(tmp_path / "hf", load_tokenizer=False)
    ids = torch.randint(0, 97, (1, 25), generator=torch.Generator().manual_seed(6))
    ref = _hf_logits(hf, ids)
    with torch.no_grad():
        got = loaded.model(ids)
        mine = ours(ids)
    if family == "dream":
        ref = torch.cat([ref[:, :1], ref[:, :-1]], dim=1)
        assert loaded.config.family == "dream"
    assert (got - ref).abs().max().item() <= 1e-4
    # And our own save format round-trips exactly.
    save_checkpoint(ours, tmp_path / "ours")
    again = load_model(tmp_path / "ours", load_tokenizer=False)
    with torch.no_grad():
        assert torch.equal(again.model(ids), mine)
    assert again.config.mask_token_id == ours.config.mask_token_id
