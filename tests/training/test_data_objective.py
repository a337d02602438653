from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.model.config import ModelConfig
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.training.data import MODES, BatchBuilder, DataConfig, chunk_attention_mask
from pdllm.shared.training.objective import compute_loss, mask_for_diffusion

SMALL = DataConfig(seq_len=384, tokens_per_batch=1536, chunk_sizes=(64, 128), max_extra_gen=6)


def only(mode: str, **kw) -> DataConfig:
    weights = tuple(1.0 if m == mode else 0.0 for m in MODES)
    return dataclasses.replace(SMALL, mode_weights=weights, **kw)


def builder(factory, tokenizer, cfg: DataConfig) -> BatchBuilder:
    return BatchBuilder(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id)


@pytest.mark.parametrize("mode", MODES)
def test_batches_have_exact_shape_and_regions(factory, tokenizer, mode):
    b = builder(factory, tokenizer, only(mode)).build(random.Random(1))
    assert b.mode == mode
    rows, t = b.ids.shape
    assert rows * t <= SMALL.tokens_per_batch and t in [
        int(SMALL.seq_len * f) for f in SMALL.length_fractions
    ]
    assert (b.ids[:, 0] == tokenizer.bos_token_id).all()
    assert not b.loss_region[:, 0].any()
    if mode in ("sft", "chunk"):
        for r in range(rows):
            region, answer = b.loss_region[r], b.answer_region[r]
            assert bool((answer & ~region).any()) is False
            assert set(b.ids[r][region & ~answer].tolist()) == {tokenizer.eos_token_id}
            starts = (answer & ~torch.roll(answer, 1)).nonzero().flatten()
            for s in starts.tolist():  # every answer follows its question's "Answer:"
                assert tokenizer.decode(b.ids[r][:s]).endswith("\nAnswer:")
            assert bool(region[-1])


def test_multi_needle_rows_ask_several_questions(factory, tokenizer):
    cfg = only("sft", task_weights=(0, 0, 0, 0, 1.0), seq_len=768, length_weights=(0, 0, 0, 1.0))
    b = builder(factory, tokenizer, cfg).build(random.Random(9))
    counts = [tokenizer.decode(row).count("\nQuestion:") for row in b.ids]
    assert max(counts) >= 2
    for r in range(b.ids.shape[0]):
        text = tokenizer.decode(b.ids[r])
        spans = (b.answer_region[r] & ~torch.roll(b.answer_region[r], 1)).nonzero().flatten().tolist()
        assert len(spans) == counts[r]
        for s in spans:
            e = s
            while e < b.ids.shape[1] and b.answer_region[r][e]:
                e += 1
            assert f" is{tokenizer.decode(b.ids[r][s:e])}." in text


def test_vanilla_answer_is_in_context(factory, tokenizer):
    b = builder(factory, tokenizer, only("sft", task_weights=(1.0, 0, 0, 0, 0))).build(random.Random(2))
    for r in range(b.ids.shape[0]):
        answer = tokenizer.decode(b.ids[r][b.answer_region[r]]).strip()
        assert f" is {answer}." in tokenizer.decode(b.ids[r])


def test_chunk_batches_and_mask(factory, tokenizer):
    b = builder(factory, tokenizer, only("chunk", p_chunk_sees_query=0.5)).build(random.Random(3))
    seg = b.segments
    for r in range(seg.shape[0]):
        starts = (seg[r][1:] != seg[r][:-1]).nonzero().flatten() + 1
        chunk_starts = [0, *[int(s) for s in starts if seg[r][s] >= 0]]
        assert all(int(b.ids[r][s]) == tokenizer.bos_token_id for s in chunk_starts)
    mask = chunk_attention_mask(seg, b.sees_query)[:, 0]
    r = 0
    q_pos = int((seg[r] < 0).nonzero()[0])
    first_chunk, second_chunk = 0, int((seg[r] == 1).nonzero()[0])
    assert mask[r, q_pos].all()  # question / answer see everything
    assert mask[r, first_chunk, first_chunk] and not mask[r, first_chunk, second_chunk]
    assert bool(mask[r, first_chunk, q_pos]) == bool(b.sees_query[r])


def test_causal_negatives_drop_the_gold_fact(factory, tokenizer):
    cfg = only("causal", p_causal_negative=1.0, p_causal_recall=0.0, task_weights=(1.0, 0, 0, 0, 0))
    b = builder(factory, tokenizer, cfg).build(random.Random(4))
    for r in range(b.ids.shape[0]):
        answer = tokenizer.decode(b.ids[r][b.answer_region[r]]).strip()
        text = tokenizer.decode(b.ids[r])
        assert text.count(answer) == 1  # only in the answer itself, not in the context


def test_recall_items_appear_twice(factory, tokenizer):
    b = builder(factory, tokenizer, only("recall")).build(random.Random(5))
    text = tokenizer.decode(b.ids[0])
    marked = tokenizer.decode(b.ids[0][b.answer_region[0]])
    fact = next(s for s in marked.split(".") if " is " in s or " works at " in s or "founded" in s)
    assert text.count(fact.strip()) >= 2


def test_mask_for_diffusion_respects_region():
    gen = torch.Generator().manual_seed(0)
    region = torch.zeros(64, 40, dtype=torch.bool)
    region[:, 30:] = True
    masked, p = mask_for_diffusion(region, 1e-3, gen)
    assert not masked[:, :30].any()
    assert masked.any(dim=1).all()
    assert ((p >= 1e-3) & (p <= 1.0)).all()
    ratio = masked[:, 30:].float().mean(dim=1)
    assert torch.corrcoef(torch.stack([ratio, p]))[0, 1] > 0.8


def tiny_model(tokenizer) -> DiffusionLM:
    cfg = ModelConfig(
        family="dream",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=True,
        shift_logits=True,
        mask_token_id=tokenizer.mask_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DiffusionLM(cfg)
    model.init_weights(0)
    return model


@pytest.mark.parametrize("mode", ["sft", "chunk", "causal"])
def test_loss_matches_model_logits_api(factory, tokenizer, mode):
    """The loss's own shift/gather equals the model's forward(logits_at=...) semantics."""
    model = tiny_model(tokenizer)
    b = builder(factory, tokenizer, only(mode)).build(random.Random(6))
    res = compute_loss(model, b, tokenizer.mask_token_id, 1e-3, torch.Generator().manual_seed(1))
    # Reference: redo the same masking draw, then use forward(logits_at) row by row.
    gen = torch.Generator().manual_seed(1)
    if mode == "causal":
        targets_at, inputs = b.loss_region, b.ids
        weight = 1.0 / b.loss_region.sum(1).float()
        attention = DenseAttention(causal=True)
    else:
        targets_at, p = mask_for_diffusion(b.loss_region, 1e-3, gen)
        inputs = torch.where(targets_at, torch.full_like(b.ids, tokenizer.mask_token_id), b.ids)
        weight = 1.0 / (p * b.loss_region.sum(1).float())
        mask = chunk_attention_mask(b.segments, b.sees_query) if mode == "chunk" else None
        attention = DenseAttention(mask=mask)
    total = 0.0
    for r in range(b.ids.shape[0]):
        mask_r = attention.mask[r : r + 1] if attention.mask is not None else None
        att = DenseAttention(mask=mask_r, causal=attention.causal)
        pos = targets_at[r].nonzero().flatten()
        logits = model(inputs[r : r + 1], attention=att, logits_at=pos[None])[0]
        ce = torch.nn.functional.cross_entropy(logits, b.ids[r, pos], reduction="sum")
        total += float((ce * weight[r]).detach())
    assert res.loss.item() == pytest.approx(total / b.ids.shape[0], rel=1e-4)


def test_causal_phase_then_configured_mix(factory, tokenizer):
    cfg = dataclasses.replace(SMALL, causal_phase_steps=100, mode_weights=only("sft").mode_weights)
    b = builder(factory, tokenizer, cfg)
    rng = random.Random(0)
    assert {b.build(rng, step).mode for step in range(0, 100, 20)} == {"causal"}
    assert {b.build(rng, step).mode for step in range(100, 200, 20)} == {"sft"}
