from __future__ import annotations

import random

import pytest

from pdllm.shared.eval.tasks import TASKS, ci_samples, format_query, make_sample, prompt_ids


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [256, 1024])
def test_sample_length_and_content(tokenizer, task, length):
    s = make_sample(task, length, 0.5, 3, tokenizer)
    assert length - 4 <= s.context_tokens <= length
    assert all(f in s.context for f in s.gold_facts)
    assert s.answer and s.answer in s.gold_facts[-1]
    assert s.query == format_query(s.question)


def test_samples_are_deterministic(tokenizer):
    a = make_sample("needle_distractors", 512, 0.3, 7, tokenizer)
    b = make_sample("needle_distractors", 512, 0.3, 7, tokenizer)
    c = make_sample("needle_distractors", 512, 0.3, 8, tokenizer)
    assert a == b
    assert a.context != c.context


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_depth(tokenizer, depth):
    s = make_sample("needle", 2048, depth, 1, tokenizer)
    at = s.context.index(s.gold_facts[0]) / len(s.context)
    assert abs(at - depth) < 0.08


def test_multidoc_gold_document_position(tokenizer):
    s = make_sample("multidoc", 2048, 1.0, 2, tokenizer)
    gold_at = s.context.index(s.gold_facts[0])
    assert s.context.rfind("Document [") < gold_at


def test_distractors_differ_from_gold(tokenizer):
    s = make_sample("needle_distractors", 1024, 0.5, 4, tokenizer)
    facts = [
        line for line in s.context.split(".") if " is " in line and (" code of " in line or " of " in line)
    ]
    assert sum(s.gold_facts[0].strip(" .") in f for f in facts) == 1


def test_prompt_ids_layout(tokenizer):
    s = make_sample("needle", 256, 0.5, 0, tokenizer)
    ids = prompt_ids(tokenizer, s)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == s.context + s.query


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", 512, 0.5, 0, tokenizer)
    with pytest.raises(ValueError, match="depth"):
        make_sample("needle", 512, 1.5, 0, tokenizer)
    with pytest.raises(ValueError, match="too short"):
        make_sample("needle_distractors", 20, 0.5, 0, tokenizer)


def test_ci_samples_fixed(tokenizer):
    a = ci_samples(tokenizer)
    assert len(a) == 10 and all(s.context_tokens <= 512 for s in a)
    assert [s.depth for s in a][0] == 0.0 and a[-1].depth == 1.0
    assert a == ci_samples(tokenizer)


def test_build_ids_exact_length_and_spans(factory, tokenizer):
    rng = random.Random(0)
    for task in TASKS:
        ctx, query, answer, spans = factory.build_ids(task, 700, rng.random(), rng)
        assert ctx.numel() == 700
        assert tokenizer.decode(answer).strip() in tokenizer.decode(ctx[spans[-1][0] : spans[-1][1]])
        assert tokenizer.decode(query).startswith("\nQuestion:")
