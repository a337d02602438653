"""Long-answer training rows: layout, masking, haystack split, and the older configs' mix."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from pdllm.shared.eval.long_answer import PASSAGE_TOKENS
from pdllm.shared.eval.tasks import split_train_eval_sentences
from pdllm.shared.training.config import CONFIG_DIR, load_config, smoke_variant
from pdllm.shared.training.corpus import _SENTENCE_END
from pdllm.shared.training.data import MODES, BatchBuilder, DataConfig

# needle_long.json's sequence length and EOS padding; small batches keep the tests fast.
CFG = DataConfig(seq_len=1088, tokens_per_batch=2176, long_answer_weight=1.0)


def builder(factory, tokenizer, mode: str, **kw) -> BatchBuilder:
    weights = tuple(1.0 if m == mode else 0.0 for m in MODES)
    cfg = dataclasses.replace(CFG, mode_weights=weights, p_causal_recall=0.0, **kw)
    return BatchBuilder(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id)


def spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) runs of True."""
    out, start = [], None
    for i, v in enumerate([*mask.tolist(), False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def check_row(tokenizer, ids: torch.Tensor, answer_region: torch.Tensor) -> str:
    """One long-answer row: the answer is the paragraph the question names, quoted from the context."""
    ((a, b),) = spans(answer_region)
    answer = tokenizer.decode(ids[a:b])
    prompt = tokenizer.decode(ids[:a])
    assert prompt.endswith("\nAnswer:") and answer.startswith(" ")
    name = prompt.rsplit("Quote the paragraph about ", 1)[1].removesuffix(".\nAnswer:")
    assert answer.strip().startswith(f"{name} was born")
    context = prompt.rsplit("\nQuestion:", 1)[0]
    assert context.count(f"\n{answer.strip()}\n") == 1  # on lines of its own, once
    assert context.count(f"{name} was born") == 1  # distractors are about other people
    assert PASSAGE_TOKENS[0] <= b - a <= PASSAGE_TOKENS[1] + 1
    return context


@pytest.mark.parametrize("mode", ["sft", "diff_task"])
def test_diffusion_rows_mask_the_answer(factory, tokenizer, mode: str) -> None:
    b = builder(factory, tokenizer, mode, length_weights=(0, 0, 0, 1.0)).build(random.Random(1))
    assert b.ids.shape == (2, 1088)
    for r in range(2):
        check_row(tokenizer, b.ids[r], b.answer_region[r])
        ((a, _),) = spans(b.answer_region[r])
        gen = b.ids[r][a:]
        eos = (gen == tokenizer.eos_token_id).nonzero().flatten()
        assert eos.numel() >= 1 and (gen[int(eos[0]) :] == tokenizer.eos_token_id).all()  # EOS padding
        if mode == "sft":  # only the answer and its EOS padding are masked
            assert spans(b.loss_region[r]) == [(a, 1088)]
        else:  # random masking over the whole row
            assert b.loss_region[r][1:].all() and not b.loss_region[r][0]


def test_causal_rows_end_in_answer_and_one_eos(factory, tokenizer) -> None:
    b = builder(factory, tokenizer, "causal", length_weights=(0, 0, 1.0, 0)).build(random.Random(2))
    for r in range(b.ids.shape[0]):
        check_row(tokenizer, b.ids[r], b.answer_region[r])
        ((_, end),) = spans(b.answer_region[r])
        assert end == b.ids.shape[1] - 1 and int(b.ids[r][-1]) == tokenizer.eos_token_id


def test_every_length_fits_or_falls_back(factory, tokenizer) -> None:
    """At seq_len 1088, rows of 544 tokens and more hold a passage twice; 272-token rows get the old tasks."""
    bld = builder(factory, tokenizer, "sft")
    rng = random.Random(3)
    assert [bld._passage_max(int(1088 * f)) for f in CFG.length_fractions] == [104, 240, 256, 256]
    for frac, longs in zip(CFG.length_fractions, (False, True, True, True), strict=True):
        t = int(1088 * frac)
        for _ in range(3):
            ids, region, answer = bld._vanilla(t, rng)
            assert ids.shape == (t,) and bool(region[-1])
            text = tokenizer.decode(ids)
            assert ("Quote the paragraph about" in text) == longs
            if longs:
                check_row(tokenizer, ids, answer)


def test_prose_comes_from_the_training_split_only(factory, tokenizer) -> None:
    _, held_out = split_train_eval_sentences()
    probes = [s.strip() for s in held_out if len(s) > 60][:3000]
    train_text = "".join(factory.hay.sentences)
    b = builder(factory, tokenizer, "sft", length_weights=(0, 0, 0, 1.0))
    rng = random.Random(4)
    for _ in range(3):
        batch = b.build(rng)
        for r in range(batch.ids.shape[0]):
            context = check_row(tokenizer, batch.ids[r], batch.answer_region[r])
            assert not any(p in context for p in probes)
            # Between the planted paragraphs, the prose is training sentences (the slack in front may
            # start mid-sentence: it is still a piece of the training text).
            lines = context.removeprefix(tokenizer.bos_token).split("\n")
            prose = [x for x in lines if x and " was born in the city of " not in x]
            pieces = [y for x in prose for y in _SENTENCE_END.split(x.strip())]
            assert pieces and all(y in train_text for y in pieces)


def test_weight_zero_draws_nothing(factory, tokenizer) -> None:
    """Configs without the field draw exactly the batches they drew before it existed."""

    class Never(BatchBuilder):
        def _long(self, t: int, rng: random.Random) -> bool:
            return False

    for mode in ("sft", "diff_task", "causal"):
        weights = tuple(1.0 if m == mode else 0.0 for m in MODES)
        cfg = DataConfig(seq_len=768, tokens_per_batch=1536, mode_weights=weights)
        assert cfg.long_answer_weight == 0.0
        a = BatchBuilder(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id).build(random.Random(5))
        b = Never(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id).build(random.Random(5))
        assert torch.equal(a.ids, b.ids) and torch.equal(a.loss_region, b.loss_region)


def test_needle_long_config_is_needle_next_plus_the_share() -> None:
    raw = {n: json.loads((CONFIG_DIR / f"{n}.json").read_text()) for n in ("needle_next", "needle_long")}
    share = raw["needle_long"]["data"].pop("long_answer_weight")
    assert 0 < share <= 0.25 and raw["needle_long"] == raw["needle_next"]
    assert load_config(CONFIG_DIR / "needle_next.json").data.long_answer_weight == 0.0


def test_smoke_variant_keeps_the_data_mix() -> None:
    cfg = load_config(CONFIG_DIR / "needle_long.json")
    smoke = smoke_variant(cfg)
    tiny = load_config(CONFIG_DIR / "smoke.json")
    assert smoke.model == tiny.model and smoke.max_steps == tiny.max_steps and smoke.num_workers == 0
    assert smoke.data.long_answer_weight == cfg.data.long_answer_weight
    assert smoke.data.task_weights == cfg.data.task_weights and smoke.data.seq_len == 1088
    assert 0 < smoke.data.causal_phase_steps < smoke.max_steps and smoke.data.tokens_per_batch == 1088
