"""SDAR (block diffusion, Qwen3 layout): logits equal transformers' Qwen3 under the same block-causal mask,
and the exact KV cache of finished blocks reproduces the full block-causal forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pdllm.shared.model.attention import DenseAttention, PrefixAttention, RecordKV
from pdllm.shared.model.config import SDAR_DEFAULT_BLOCK_SIZE, SDAR_MASK_ID
from pdllm.shared.model.loader import CheckpointError, load_model, save_checkpoint
from pdllm.shared.model.sdar import BlockCausalAttention, block_causal_mask
from pdllm.shared.model.transformer import DiffusionLM

from .helpers import tiny_model


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean mask as 0 / -inf (the form transformers' eager attention adds to its scores)."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


def _hf_qwen3(
    kv_heads: int, tied: bool, block_size: int | None, rope: dict | None = None
) -> Qwen3ForCausalLM:
    """A tiny random Qwen3 with every weight drawn (norm weights near 1, not exactly: a swapped or
    dropped q/k norm must show in the logits)."""
    extra = {} if block_size is None else {"block_size": block_size}
    if rope is not None:
        extra["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    cfg = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        attn_implementation="eager",
        **extra,
    )
    hf = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return hf.eval()


def _hf_block_causal_logits(hf: Qwen3ForCausalLM, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])
    mask = additive_mask(block_causal_mask(positions, None, block_size)).expand(ids.shape[0], -1, -1, -1)
    with torch.no_grad():  # a 4-D float mask is taken as is and added to the eager attention scores
        return hf(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("block_size", [None, 1, 5], ids=["default", "b1", "b5"])
def test_logits_match_transformers_qwen3(
    tmp_path: Path, kv_heads: int, tied: bool, block_size: int | None
) -> None:
    hf = _hf_qwen3(kv_heads, tied, block_size)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    cfg = loaded.config
    assert (cfg.family, cfg.qk_norm, cfg.shift_logits, cfg.tie_word_embeddings) == ("sdar", True, False, tied)
    assert cfg.block_size == (block_size or SDAR_DEFAULT_BLOCK_SIZE)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(3))
    ref = _hf_block_causal_logits(hf, ids, cfg.block_size)
    with torch.no_grad():
        got = loaded.model(ids)  # SDAR's default attention is block-causal with the config's block size
    assert (got - ref).abs().max().item() <= 1e-4
    if cfg.block_size > 1:  # the mask matters: bidirectional attention gives other logits
        with torch.no_grad():
            full = loaded.model(ids, attention=DenseAttention())
        assert (full - ref).abs().max().item() > 1e-2


def test_scaled_rope_matches_transformers_qwen3(tmp_path: Path) -> None:
    hf = _hf_qwen3(
        2, False, 4, rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    )
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = loaded.model(ids)
    assert (got - _hf_block_causal_logits(hf, ids, 4)).abs().max().item() <= 1e-4


def test_block_causal_mask() -> None:
    m = block_causal_mask(torch.arange(5), None, 2)[0, 0]
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)
    # Blocks come from positions: queries at 6..7 (block 3) see cached keys 0..5 and themselves.
    m = block_causal_mask(torch.tensor([[6, 7]]), torch.arange(8)[None], 2)
    assert m.shape == (1, 1, 2, 8) and bool(m.all())
    with pytest.raises(ValueError, match="block_size"):
        block_causal_mask(torch.arange(3), None, 0)


def _blockwise_logits(model: DiffusionLM, ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Run the spans (whole blocks each) in order, each over the recorded K/V of the spans before it."""
    block = model.config.block_size
    assert block is not None
    cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    done = 0
    out = []
    for start, end in spans:
        assert start == done
        positions = torch.arange(start, end)
        inner = BlockCausalAttention(positions, block, cache, torch.arange(start) if cache else None)
        rec = RecordKV(inner)
        with torch.no_grad():
            out.append(model(ids[:, start:end], positions.expand(ids.shape[0], -1), attention=rec))
        new = list(zip(rec.keys, rec.values, strict=True))
        cache = (
            new
            if cache is None
            else [
                (torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                for (pk, pv), (k, v) in zip(cache, new, strict=True)
            ]
        )
        done = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_exact_cache_of_finished_blocks_reproduces_full_forward(kv_heads: int) -> None:
    model = tiny_model("sdar", num_kv_heads=kv_heads, seed=2)
    ids = torch.randint(0, 97, (2, 18), generator=torch.Generator().manual_seed(5))  # 4 blocks of 4, then 2
    with torch.no_grad():
        full = model(ids)
    one_by_one = [(0, 4), (4, 8), (8, 12), (12, 16), (16, 18)]
    chunked = [(0, 8), (8, 16), (16, 18)]  # a prompt prefilled a few blocks at a time, then decoded on
    for spans in (one_by_one, chunked):
        assert (_blockwise_logits(model, ids, spans) - full).abs().max().item() <= 1e-5


def test_one_block_over_cache_is_prefix_attention() -> None:
    """Decoding one block over the finished blocks' cache is the existing PrefixAttention (every cached
    token visible, the block bidirectional), so the static-KV decode paths can serve SDAR's blocks."""
    model = tiny_model("sdar", seed=3)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(6))
    rec = RecordKV(BlockCausalAttention(torch.arange(8), 4))
    with torch.no_grad():
        model(ids[:, :8], attention=rec)
        prefix = list(zip(rec.keys, rec.values, strict=True))
        got = model(ids[:, 8:], torch.arange(8, 12)[None], attention=PrefixAttention(prefix))
        full = model(ids)
    assert (got - full[:, 8:]).abs().max().item() <= 1e-5


def test_own_checkpoint_round_trips(tmp_path: Path) -> None:
    model = tiny_model("sdar", block_size=8, output_bias=True, attention_bias=True, tie_word_embeddings=True)
    save_checkpoint(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw["model_type"], raw["block_size"]) == ("sdar", 8)
    loaded = load_model(tmp_path, load_tokenizer=False)
    assert loaded.config.replace(model_id="x") == model.config.replace(model_id="x")
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), model(ids))


def test_sdar_config_defaults_and_errors(tmp_path: Path) -> None:
    hf = _hf_qwen3(2, False, None)
    hf.save_pretrained(tmp_path)
    assert load_model(tmp_path, load_tokenizer=False).config.mask_token_id == SDAR_MASK_ID
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**raw, "use_sliding_window": True, "sliding_window": 8})
    )
    with pytest.raises(CheckpointError, match="sliding-window"):
        load_model(tmp_path, load_tokenizer=False)
