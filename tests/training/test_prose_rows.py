"""Prose in the training mix: prose ``text`` rows, infilling rows (layout as evaluated), seeded batches,
the judge preset, and every older config's batches unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdllm.shared.eval.infilling import GAP, QUESTION, SPAN_TOKENS
from pdllm.shared.eval.tasks import format_query
from pdllm.shared.training import train as train_mod
from pdllm.shared.training.config import load_config
from pdllm.shared.training.data import MODES, BatchBuilder, DataConfig
from pdllm.shared.training.prose import tokenize_prose
from tests.eval.test_infilling import make_docs

ROOT = Path(__file__).resolve().parents[2]
# Batch digests of the older configs (``batch_digests``) with data.py as it was before the prose fields
# existed (and the retrieval tasks' other keys drawn in sorted order, so no batch depends on the hash seed).
GOLDEN = {
    "smoke": "45982fa57162cd02",
    "needle": "9778261f203126fb",
    "needle_curriculum": "b856e31d88983ef6",
    "needle_next": "f8695bc8318c06ef",
    "needle_long": "3c250bdd5501cc76",
}


def batch_digests() -> dict[str, str]:
    """24 one-row batches per config (steps 0..4600: both phases), hashed field by field."""
    from pdllm.shared.eval.tasks import TaskFactory, split_train_eval_sentences
    from pdllm.shared.training.corpus import tokenize_haystack
    from pdllm.shared.training.tokenizer import load_tokenizer

    tok = load_tokenizer()
    factory = TaskFactory(tok, tokenize_haystack(tok, split_train_eval_sentences()[0][:2000]))
    out = {}
    for name in GOLDEN:
        cfg = load_config(train_mod.CONFIG_DIR / f"{name}.json").data
        builder = BatchBuilder(
            dataclasses.replace(cfg, tokens_per_batch=cfg.seq_len),
            factory,
            tok.bos_token_id,
            tok.eos_token_id,
        )
        rng, h = random.Random(7), hashlib.sha256()
        for step in range(24):
            b = builder.build(rng, step * 200)
            for x in (b.ids, b.loss_region, b.answer_region, b.segments, b.sees_query):
                if x is not None:
                    h.update(x.numpy().tobytes())
            h.update(b.mode.encode())
        out[name] = h.hexdigest()[:16]
    return out


@pytest.mark.parametrize("hash_seed", ["0", "1"])
def test_older_configs_draw_the_same_batches(hash_seed: str) -> None:
    """Every config without the prose fields draws the batches it drew before them, byte for byte, whatever
    the hash seed. Plant: drawing ``rng.random()`` in ``_is_infill`` before checking the weight (or for
    every ``text`` row) changes every digest and fails here; the distractor's other key drawn from
    ``set(KEYS)`` unsorted -> one of the two hash seeds fails."""
    code = "import json; from tests.training.test_prose_rows import batch_digests; print(json.dumps(batch_digests()))"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == GOLDEN
    for name in GOLDEN:
        data = load_config(train_mod.CONFIG_DIR / f"{name}.json").data
        assert (data.prose_file, data.prose_text_share, data.infill_weight) == ("", 0.0, 0.0)


@pytest.fixture(scope="module")
def prose(tokenizer):
    return tokenize_prose(tokenizer, [d.split("\n") for d in make_docs(16, seed=5)])


def builder(factory, tokenizer, prose, mode: str, **kw) -> BatchBuilder:
    weights = tuple(1.0 if m == mode else 0.0 for m in MODES)
    cfg = DataConfig(seq_len=1088, tokens_per_batch=2176, mode_weights=weights, **kw)
    return BatchBuilder(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id, prose)


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    idx = mask.nonzero().flatten().tolist()
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def find(haystack: list[int], needle: list[int]) -> list[int]:
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i : i + n] == needle]


@pytest.mark.parametrize("mode", ["sft", "diff_task"])
def test_infill_rows_are_the_evaluated_layout(factory, tokenizer, prose, mode: str) -> None:
    """[BOS] prefix [BLANK] suffix question span EOS...: the span is a word-aligned piece of one document,
    prefix + span + suffix is a contiguous stretch of the prose. Plant: cutting the suffix at ``s + n + 1``
    (one token skipped after the span) fails the contiguity check."""
    bld = builder(factory, tokenizer, prose, mode, infill_weight=1.0, length_weights=(0.5, 0, 0, 0.5))
    gap, query = tokenizer.encode(GAP), tokenizer.encode(format_query(QUESTION))
    stream = prose.hay.ids.tolist() * 2
    rng = random.Random(11)
    for _ in range(4):
        b = bld.build(rng)
        t = b.ids.shape[1]
        for r in range(b.ids.shape[0]):
            ids = b.ids[r].tolist()
            ((a, e),) = runs(b.answer_region[r])
            assert SPAN_TOKENS[0] <= e - a <= SPAN_TOKENS[1]
            assert ids[0] == tokenizer.bos_token_id and ids[a - len(query) : a] == query
            assert set(ids[e:]) == {tokenizer.eos_token_id} and 1 <= t - e <= 1 + bld.cfg.max_extra_gen
            (g,) = find(ids[: a - len(query)], gap)
            span = ids[a:e]
            assert tokenizer.decode(span).startswith(" ")
            assert any(tokenizer.decode(span) in "\n".join(d.split("\n")) for d in make_docs(16, seed=5))
            spliced = ids[1:g] + span + ids[g + len(gap) : a - len(query)]
            assert find(stream, spliced), "prefix + span + suffix is not a stretch of the prose"
            if mode == "sft":
                assert runs(b.loss_region[r]) == [(a, t)]
            else:
                assert b.loss_region[r][1:].all() and not b.loss_region[r][0]


def test_prose_text_rows_come_from_the_prose(factory, tokenizer, prose) -> None:
    bld = builder(factory, tokenizer, prose, "text", prose_text_share=1.0)
    stream = prose.hay.ids.tolist() * 2
    starts = set(prose.hay.offsets.tolist())
    b = bld.build(random.Random(12))
    for r in range(b.ids.shape[0]):
        body = b.ids[r, 1:].tolist()
        hits = find(stream, body[:64])
        assert hits and any(h % prose.hay.num_tokens in starts for h in hits)  # from a paragraph start


def test_batches_are_seeded(factory, tokenizer, prose) -> None:
    cfg = load_config(train_mod.CONFIG_DIR / "judge_dream.json").data
    cfg = dataclasses.replace(cfg, tokens_per_batch=cfg.seq_len)
    bld = BatchBuilder(cfg, factory, tokenizer.bos_token_id, tokenizer.eos_token_id, prose)
    a = [bld.build(random.Random(3), s * 300) for s in range(12)]
    b = [bld.build(random.Random(3), s * 300) for s in range(12)]
    assert all(torch.equal(x.ids, y.ids) and torch.equal(x.loss_region, y.loss_region) for x, y in zip(a, b))
    c = bld.build(random.Random(4), 0)
    assert not torch.equal(a[0].ids, c.ids)


def test_prose_fields_need_the_corpus(factory, tokenizer) -> None:
    with pytest.raises(ValueError, match="prose_file"):
        BatchBuilder(DataConfig(infill_weight=0.2), factory, tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_judge_preset_loads_and_is_small(tokenizer) -> None:
    from pdllm.shared.model.transformer import DiffusionLM

    cfg = load_config(train_mod.CONFIG_DIR / "judge_dream.json")
    assert (
        cfg.data.prose_text_share > 0 and 0 < cfg.data.infill_weight < 1 and cfg.data.long_answer_weight > 0
    )
    assert train_mod.prose_path(cfg) == ROOT / "shared/training/data/prose/prose_train.txt.gz"
    model_cfg = train_mod.build_model_config(cfg, tokenizer)
    assert model_cfg.family == "dream"
    with torch.device("meta"):
        params = DiffusionLM(model_cfg).num_parameters()
    assert params == 23_869_952 and 2 * params < 50e6  # bf16 checkpoint under 50 MB
    smoke = train_mod.smoke_variant(cfg)
    assert smoke.data.prose_file == cfg.data.prose_file and smoke.data.infill_weight == cfg.data.infill_weight


def test_judge_smoke_trains_on_prose(tmp_path, tokenizer) -> None:
    """The judge preset's mix at smoke scale (a fixture prose file), a few CPU steps."""
    import gzip

    path = tmp_path / "prose_train.txt.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("\n\n".join(make_docs(16, seed=6)) + "\n")
    cfg = train_mod.smoke_variant(load_config(train_mod.CONFIG_DIR / "judge_dream.json"))
    data = dataclasses.replace(cfg.data, prose_file=str(path), causal_phase_steps=2, infill_weight=1.0)
    cfg = dataclasses.replace(cfg, max_steps=8, log_every=1, data=data)
    stats = train_mod.train(cfg, tmp_path / "run", None, "cpu", progress=False)
    assert stats["steps"] == 8 and stats["prose"]["tokens"] > 5_000
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert all(r["modes"] for r in log) and (tmp_path / "run" / "checkpoint").is_dir()
