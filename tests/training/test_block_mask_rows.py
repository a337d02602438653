"""Block-decoding masks (``DataConfig.block_mask_share``): share 0 draws the batches of a config without the
fields, share 1 gives every
``sft`` / ``chunk`` row a block decoder's mask, the loss of such a row scores its masked tokens only.

Planted, each seen to fail and reverted:
- (i) ``block_bounds`` starts the block one token past a multiple of ``block_mask_length``
  (``first + length * k + 1``) -> ``test_share_one_rows_have_the_block_layout`` fails (alignment).
- (ii) ``mask_for_block_decoding`` returns ``masked`` without ``| after`` (tokens after the block clean)
  -> ``test_share_one_rows_have_the_block_layout`` fails (the tail must be all masked).
- (iii) ``BatchBuilder.build`` draws ``rng.random()`` for every ``sft`` / ``chunk`` batch whatever the share
  -> ``test_share_zero_draws_the_unchanged_batches`` fails (both cases: the digest of later batches and the rng's
  next number change); so does drawing ``block_bounds`` at share 0 (``> 0`` check dropped).
- (iv) ``mask_for_block_decoding`` returns ``region`` as the scored region (the clean prefix counted as
  scored) -> ``test_share_one_rows_have_the_block_layout`` and
  ``test_block_row_loss_scores_the_masked_tokens_only`` fail.
- (v) ``compute_loss`` divides block rows by the whole loss region, clean prefix included (discarding the
  scored region) -> ``test_block_row_loss_scores_the_masked_tokens_only`` fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import pytest
import torch

from pdllm.shared.training.config import CONFIG_DIR, TrainConfigError, load_config
from pdllm.shared.training.data import MODES, BatchBuilder, DataConfig
from pdllm.shared.training.objective import compute_loss, mask_for_block_decoding, mask_for_diffusion
from tests.training.test_data_objective import tiny_model

SMALL = DataConfig(seq_len=384, tokens_per_batch=1536, chunk_sizes=(64, 128), max_extra_gen=24)


def only(mode: str, **kw) -> DataConfig:
    return dataclasses.replace(SMALL, mode_weights=tuple(float(m == mode) for m in MODES), **kw)


def builder(factory, tokenizer, cfg: DataConfig) -> BatchBuilder:
    return BatchBuilder(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id)


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of True in a 1-D mask."""
    out: list[tuple[int, int]] = []
    for i in mask.nonzero().flatten().tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


# Digest (``digest``) of 40 batches of ``TODAY`` drawn by data.py as it was before the block-mask fields.
GOLDEN = "61ea7a71f056514e"
TODAY = dataclasses.replace(SMALL, long_answer_weight=0.3)


def digest(bld: BatchBuilder, rng: random.Random) -> str:
    """40 batches hashed field by field (every mode comes up), then the rng's next number."""
    h = hashlib.sha256()
    for _ in range(40):
        b = bld.build(rng)
        assert b.block_bounds is None
        for x in (b.ids, b.loss_region, b.answer_region, b.segments, b.sees_query):
            if x is not None:
                h.update(x.numpy().tobytes())
        h.update(b.mode.encode())
    h.update(repr(rng.random()).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("fields", [{}, {"block_mask_share": 0.0, "block_mask_length": 8}])
def test_share_zero_draws_the_unchanged_batches(factory, tokenizer, fields) -> None:
    """A config without the fields, or with them at share 0 (any length), draws the batches data.py drew
    before them, bit for bit, over every mode, and leaves the rng where it left it: no random number is
    drawn for them."""
    cfg = dataclasses.replace(TODAY, **fields)
    assert digest(builder(factory, tokenizer, cfg), random.Random(11)) == GOLDEN


@pytest.mark.parametrize(
    ("mode", "length", "kw"),
    [
        ("sft", 8, {}),
        ("sft", 4, {"task_weights": (0, 0, 0, 0, 1.0), "seq_len": 768}),  # multi_needle: several answers
        ("chunk", 8, {}),
        ("sft", 32, {"long_answer_weight": 1.0, "seq_len": 1088}),
    ],
)
def test_share_one_rows_have_the_block_layout(factory, tokenizer, mode, length, kw) -> None:
    """Every row: a clean prefix of its generation region ending at a multiple of the block length (counted
    from the region's last run), a block with a masked token, then only masked tokens; nothing outside the
    region masked (context, question, earlier answers' questions)."""
    cfg = only(mode, block_mask_share=1.0, block_mask_length=length, **kw)
    bld, rng, gen = builder(factory, tokenizer, cfg), random.Random(5), torch.Generator().manual_seed(3)
    blocks_drawn = set()
    for _ in range(6):
        b = bld.build(rng)
        masked, scored, p = mask_for_block_decoding(b.loss_region, b.block_bounds, 1e-3, gen)
        for r in range(b.ids.shape[0]):
            region = b.loss_region[r]
            start, end = b.block_bounds[r].tolist()
            first, last = runs(region)[-1]
            assert not (masked[r] & ~region).any()
            assert (start - first) % length == 0 and first <= start < last
            assert end == min(start + length, last)
            assert not masked[r, :start].any() and not scored[r, :start].any()
            assert masked[r, start:end].any()
            assert masked[r, end:last].all() and (p[r, end:last] == 1).all()
            assert scored[r, start:last].all()
            blocks_drawn.add((start - first) // length)
    assert 0 in blocks_drawn and len(blocks_drawn) >= 2


def test_block_row_loss_scores_the_masked_tokens_only(factory, tokenizer) -> None:
    """compute_loss on block-masked rows equals the sum over the masked tokens alone of their cross-entropy
    (the model's own logits API), weighted 1 / (p * scored tokens) in the block and 1 / scored tokens after
    it; the clean prefix neither scored nor counted. Half the rows are block rows, half one-ratio rows."""
    model = tiny_model(tokenizer)
    cfg = only("sft", block_mask_share=0.5, block_mask_length=8, seq_len=768, length_weights=(0, 0, 0, 1.0))
    b = builder(factory, tokenizer, cfg).build(random.Random(8))
    planned = b.block_bounds[:, 0] >= 0
    assert planned.any() and not planned.all()
    res = compute_loss(model, b, tokenizer.mask_token_id, 1e-3, torch.Generator().manual_seed(1))
    # The same draw as compute_loss makes: the ratio region is the block (block rows) or the region.
    pos = torch.arange(b.ids.shape[1])[None]
    start, end = b.block_bounds[:, :1], b.block_bounds[:, 1:]
    prefix = planned[:, None] & (pos < start)
    after = planned[:, None] & (pos >= end) & b.loss_region
    ratio_region = b.loss_region & ~prefix & ~after
    masked, p_row = mask_for_diffusion(ratio_region, 1e-3, torch.Generator().manual_seed(1))
    masked |= after
    n_scored = (b.loss_region & ~prefix).sum(1).float()
    inputs = torch.where(masked, torch.full_like(b.ids, tokenizer.mask_token_id), b.ids)
    total = 0.0
    for r in range(b.ids.shape[0]):
        at = masked[r].nonzero().flatten()
        assert not (masked[r] & prefix[r]).any()
        logits = model(inputs[r : r + 1], logits_at=at[None])[0]
        ce = torch.nn.functional.cross_entropy(logits, b.ids[r, at], reduction="none")
        w = torch.where(after[r, at], 1.0, 1.0 / p_row[r]) / n_scored[r]
        total += float((ce * w).sum().detach())
    assert res.loss.item() == pytest.approx(total / b.ids.shape[0], rel=1e-4)


def test_preset_is_judge_dream_plus_block_masks(tmp_path) -> None:
    raw = json.loads((CONFIG_DIR / "judge_dream_blocks.json").read_text())
    base = json.loads((CONFIG_DIR / "judge_dream.json").read_text())
    assert raw["data"].pop("block_mask_share") == 0.5 and raw["data"].pop("block_mask_length") == 32
    assert raw == base and raw["name"] == "pdllm-judge-dream"
    assert load_config(CONFIG_DIR / "judge_dream_blocks.json").data.block_mask_share == 0.5
    sdar = json.loads((CONFIG_DIR / "judge_sdar.json").read_text())
    sdar["data"]["block_mask_share"] = 0.5
    (tmp_path / "bad.json").write_text(json.dumps(sdar))
    with pytest.raises(TrainConfigError, match="Dream-layout"):
        load_config(tmp_path / "bad.json")
