"""FOCUS (``decode_service/policies/focus*.py``) on tiny fp32 models of 4 layers (layers >= 2 exist to
evict from): SDAR block by block over its exact cache, Dream and LLaDA under the semi-AR blocks, vanilla and
over a pdllm-style static KV backend.

Identities: a budget of the block length evicts nothing; without the intra-block cache every step then
forwards every row and equals plain decoding token for token. The fast path (several requests packed into
one forward) equals the reference request by request, tokens and counters. The importance (Eq. 2) and the
selection (Algorithm 1) are held to from-scratch computations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdllm.decode_service.block_diffusion import answer_spans
from pdllm.decode_service.policies.focus import FocusConfig, FocusMemory, importance, select
from pdllm.decode_service.policies.focus_batch import FocusDecodeBatch, generate_focus_batched
from pdllm.decode_service.policies.focus_fast import importance_batched, select_batched
from pdllm.decode_service.policies.focus_reference import (
    FocusLogits,
    FocusSession,
    generate_focus_block_diffusion,
    run_focus,
)
from pdllm.decode_service.vanilla import generate_vanilla
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, denoise
from pdllm.shared.model.attention import AttentionBackend, DenseAttention, PrefixAttention, RecordKV
from pdllm.shared.model.transformer import DiffusionLM

from ..model.helpers import tiny_model

PROMPTS = [
    [1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3, 58],
    [1, 5, 6, 7, 8, 9, 10],
    [4, 44, 55, 66, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
]
FAMILIES = ["sdar", "dream", "llada"]
# (gen_length, steps, block_length, threshold)
SCHEDULES = [(16, 16, 4, None), (16, 8, 8, None), (16, 16, 8, 0.05), (16, 16, 16, 0.04)]
PAPER = FocusConfig()  # alpha 1.5, MaxPool kernel 3, intra-block cache on
OTHER = FocusConfig(alpha=1.2, pool_kernel=5, delayed_cache=False)
FIXED = FocusConfig(budget=2, pool_kernel=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny forwards gain nothing from a second thread, and on a busy 2-core box the idle OpenMP worker's
    spin-waiting makes them ~40x slower; the previous setting is restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(family: str, seed: int = 0) -> DiffusionLM:
    return tiny_model(family, seed=seed, num_layers=4)


def _gen(gen: int, steps: int, block: int | None, threshold: float | None, **kw: Any) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False, **kw
    )


def _local(
    model: DiffusionLM, head: list[int], gen: GenerationConfig, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    local = torch.tensor(head + [model.config.mask_token_id] * gen.gen_length)
    return local, torch.arange(first, first + local.numel())


def _reference(
    model: DiffusionLM,
    head: list[int],
    gen: GenerationConfig,
    focus: FocusConfig,
    inner: AttentionBackend | None = None,
    first: int = 0,
) -> GenerationResult:
    if model.config.block_size is not None:
        return generate_focus_block_diffusion(model, torch.tensor(head), gen, focus)
    local, positions = _local(model, head, gen, first)
    return run_focus(
        FocusLogits(model, local, positions[None], len(head), gen, focus, inner or DenseAttention())
    )


def _static(model: DiffusionLM, length: int) -> PrefixAttention:
    """pdllm's static chunk KV, as the method's backend reads it: K/V of ``length`` context tokens."""
    ids = torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(length))
    record = RecordKV(DenseAttention())
    with torch.inference_mode():
        model.hidden_states(ids, attention=record)
    return PrefixAttention(list(zip(record.keys, record.values, strict=True)))


def _plain_over(
    model: DiffusionLM, head: list[int], gen: GenerationConfig, inner: AttentionBackend, first: int
) -> GenerationResult:
    """Plain decoding over the static KV (every local row every step), the reference's own loop."""
    local, positions = _local(model, head, gen, first)
    p = len(head)

    def logits_fn(response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        local[p:] = response
        return model(local[None], positions[None], inner, logits_at=(at + p)[None])[0]

    with torch.inference_mode():
        return denoise(gen, model.config.mask_token_id, model.config.eos_token_id, logits_fn)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_budget_of_the_block_without_the_intra_block_cache_is_plain_decoding(
    family: str, schedule: tuple
) -> None:
    model, gen = _model(family, seed=1), _gen(*schedule)
    plain = generate_vanilla(model, PROMPTS[0], gen)
    for focus in (
        FocusConfig(budget=gen.block, delayed_cache=False),
        FocusConfig(alpha=1e6, delayed_cache=False),
    ):
        out = _reference(model, PROMPTS[0], gen, focus)
        assert out.raw_tokens == plain.raw_tokens and out.steps == plain.steps
        assert out.cache["rows_forwarded"] == out.cache["rows_plain"] and out.cache["evicted"] == 0
    fast = generate_focus_batched(model, PROMPTS[:1], gen, FocusConfig(budget=gen.block, delayed_cache=False))
    assert fast[0].raw_tokens == plain.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_budget_of_the_block_over_static_kv_is_plain_decoding(family: str) -> None:
    """Composed with chunk selection: the method's backend reads the static KV, FOCUS sees local rows."""
    model, gen = _model(family, seed=2), _gen(16, 16, 8, None)
    inner = _static(model, 20)
    plain = _plain_over(model, PROMPTS[1], gen, inner, first=20)
    out = _reference(model, PROMPTS[1], gen, FocusConfig(budget=8, delayed_cache=False), inner, first=20)
    assert out.raw_tokens == plain.raw_tokens
    evicting = _reference(model, PROMPTS[1], gen, PAPER, inner, first=20)
    assert evicting.cache["evicted"] > 0 and evicting.steps == plain.steps  # the schedule is kept


def _assert_fast_equals_reference(fast: list[GenerationResult], refs: list[GenerationResult]) -> None:
    for ref, got in zip(refs, fast, strict=True):
        assert got.raw_tokens == ref.raw_tokens and got.steps == ref.steps
        assert got.cache == ref.cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("focus", [PAPER, OTHER, FIXED], ids=["paper", "other", "fixed-k"])
@pytest.mark.parametrize(("schedule", "seed"), [(s, i) for i, s in enumerate(SCHEDULES)], ids=str)
def test_fast_path_equals_reference(family: str, focus: FocusConfig, schedule: tuple, seed: int) -> None:
    """Three requests of different lengths in one packed batch (different kept counts every step)."""
    model, gen = _model(family, seed), _gen(*schedule)
    refs = [_reference(model, p, gen, focus) for p in PROMPTS]
    _assert_fast_equals_reference(generate_focus_batched(model, PROMPTS, gen, focus), refs)
    assert sum(r.cache["evicted"] for r in refs) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_equals_reference_at_the_papers_defaults(family: str) -> None:
    """Block 32, confidence threshold 0.8 (§5.2), two blocks; plus a sampled and an EOS-stopped run."""
    model = _model(family, seed=3)
    gen = _gen(64, 64, 32, 0.8)
    refs = [_reference(model, p, gen, PAPER) for p in PROMPTS[:2]]
    _assert_fast_equals_reference(generate_focus_batched(model, PROMPTS[:2], gen, PAPER), refs)
    sampled = _gen(16, 16, 8, None, temperature=0.7, seed=5)
    refs = [_reference(model, p, sampled, PAPER) for p in PROMPTS]
    fast = generate_focus_batched(model, PROMPTS, sampled, PAPER)
    _assert_fast_equals_reference(fast, refs)
    eos = GenerationConfig(gen_length=16, steps=16, block_length=4, temperature=0.7, seed=5)
    free = _reference(model, PROMPTS[0], dataclasses.replace(eos, stop_at_eos=False), PAPER)
    model.config = model.config.replace(eos_token_id=free.raw_tokens[5])
    refs = [_reference(model, p, eos, PAPER) for p in PROMPTS]
    fast = generate_focus_batched(model, PROMPTS, eos, PAPER)
    _assert_fast_equals_reference(fast, refs)
    assert any(r.steps < 16 for r in refs)  # a request stopped early while the others went on


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_fast_path_equals_reference_over_static_kv(family: str) -> None:
    model, gen = _model(family, seed=4), _gen(16, 16, 8, 0.05)
    inners = [_static(model, n) for n in (12, 20, 9)]
    refs = [
        _reference(model, p, gen, PAPER, inner, inner.prefix[0][0].shape[2])
        for p, inner in zip(PROMPTS, inners, strict=True)
    ]
    batch = FocusDecodeBatch(model, gen, PAPER, slots=3)
    for p, inner in zip(PROMPTS, inners, strict=True):
        local, positions = _local(model, p, gen, inner.prefix[0][0].shape[2])
        batch.local(local, positions, len(p), inner)
    _assert_fast_equals_reference(batch.run(), refs)


@pytest.mark.parametrize("family", FAMILIES)
def test_focus_forwards_fewer_rows_and_keeps_the_schedule(family: str) -> None:
    model, gen = _model(family), _gen(64, 64, 32, None)
    out = _reference(model, PROMPTS[0], gen, PAPER)
    c = out.cache
    assert c["policy"] == "focus" and c["forwards"] == out.steps == 64  # the fixed schedule's steps
    assert c["rows_forwarded"] < c["rows_plain"] and c["evicted"] > 0 and c["frozen"] > 0
    spans = answer_spans(len(PROMPTS[0]), 64, 32) if family == "sdar" else [(0, 32), (32, 64)]
    assert c["decoded"] == 64 and c["focused"] + c["evicted"] == sum(
        (b - a) * (b - a + 1) // 2 for a, b in spans
    )
    if family == "sdar":  # the window is the block: FOCUS's cut shows in full (Table 5 counts layer 2+)
        assert c["rows_forwarded"] <= 0.4 * c["rows_plain"]


def test_evicted_rows_are_never_unmasked() -> None:
    model, gen = _model("llada", seed=6), _gen(16, 16, 16, 0.05)
    local, positions = _local(model, PROMPTS[0], gen)
    fn = FocusLogits(model, local, positions[None], len(PROMPTS[0]), gen, PAPER, DenseAttention())
    session, seen = FocusSession(fn), []
    take = fn.take_eligible
    fn.take_eligible = lambda: seen.append(take()) or seen[-1]  # type: ignore[method-assign]
    while not session.done:
        at = session.state.positions()
        picked = session.step()
        assert set(picked.tolist()) <= set(at[seen[-1]].tolist())
    assert any(not bool(e.all()) for e in seen)
    with pytest.raises(RuntimeError, match="eligible rows never reached the sampler"):
        local2, pos2 = _local(model, PROMPTS[0], gen)
        plain_fn = FocusLogits(model, local2, pos2[None], len(PROMPTS[0]), gen, PAPER, DenseAttention())
        plain_fn.bind(DenoiseState(gen, model.config.mask_token_id, None))
        denoise(gen, model.config.mask_token_id, None, plain_fn)  # a plain denoise would ignore eviction


def _importance_from_scratch(
    q: torch.Tensor, k: torch.Tensor, queries: list[int], kernel: int
) -> list[float]:
    """Eq. 2 with loops in float64: per head and query, max-pool the scores over neighbouring keys (window
    clipped at the ends), softmax over the block's keys, sum over heads and queries."""
    heads, b, dim = q.shape[0], k.shape[1], q.shape[2]
    out = [0.0] * b
    for h in range(heads):
        for i in queries:
            s = [
                float(q[h, i].double() @ k[h // (heads // k.shape[0]), j].double()) / math.sqrt(dim)
                for j in range(b)
            ]
            pooled = [max(s[max(0, j - kernel // 2) : j + kernel // 2 + 1]) for j in range(b)]
            z = sum(math.exp(x - max(pooled)) for x in pooled)
            for j in range(b):
                out[j] += math.exp(pooled[j] - max(pooled)) / z
    return out


@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_importance_matches_the_papers_equation(kernel: int) -> None:
    g = torch.Generator().manual_seed(kernel)
    q, k = torch.randn(4, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    queries = [0, 2, 3, 5, 6, 7]
    want = _importance_from_scratch(q, k, queries, kernel)
    assert importance(q[:, queries], k, kernel).tolist() == pytest.approx(want, rel=1e-12)
    qpad = torch.zeros(2, 4, 10, 16)
    qpad[0, :, :8], qpad[1, :, :6] = q, q[:, :6]
    kpad = torch.zeros(2, 2, 10, 16)
    kpad[0, :, :8], kpad[1, :, :6] = k, k[:, :6]
    rows = torch.arange(10)
    qmask = torch.stack([torch.isin(rows, torch.tensor(queries)), torch.isin(rows, torch.tensor([1, 4]))])
    kvalid = torch.stack([rows < 8, rows < 6])
    got = importance_batched(qpad, kpad, qmask, kvalid, kernel)
    assert got[0, :8].tolist() == pytest.approx(want, rel=1e-12) and got[0, 8:].abs().sum() == 0
    assert got[1, :6].tolist() == pytest.approx(
        _importance_from_scratch(q[:, :6], k[:, :6], [1, 4], kernel), rel=1e-12
    )


def test_selection_follows_algorithm_1() -> None:
    """Rows 0-1 decoded (1 frozen), 2-7 masked; 0-3 forwarded past layer 1 before (reach 4). K = 2: the
    top deltas 6 and 3, their predecessors 5 and 2, the unprocessed masked rows 4 and 5 before 6, decoded
    row 0; not frozen row 1, not masked row 7."""
    mem = FocusMemory(decoded_sum=3, steps=3)  # Nbar = 1: ceil(1.5) = 2
    mem.start_block(0, [False, False, True, True, True, True, True, True], delayed_cache=False)
    mem.frozen[1], mem.reach = True, 4
    delta = torch.tensor([5.0, 4.0, -0.1, 0.4, -0.3, -0.2, 0.5, -0.25], dtype=torch.float64)
    sel = select(delta, mem, PAPER, 8, None)
    assert sel.top == [3, 6] and sel.rows == [0, 2, 3, 4, 5, 6] and sel.reach == 7
    assert select(delta, mem, PAPER, 8, 4).top == [2, 3, 5, 6]  # the schedule's quota raises K
    d, masked = delta[None], torch.tensor([mem.masked])
    frozen, valid = torch.tensor([mem.frozen]), torch.ones(1, 8, dtype=torch.bool)
    chosen = select_batched(
        d, masked, frozen, valid, torch.tensor([4]), torch.tensor([2]), torch.tensor([0]), PAPER, 8
    )
    assert chosen[0].nonzero().flatten().tolist() == sel.rows


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"alpha": 1.0}, r"alpha must be a finite number > 1"),
        ({"alpha": float("inf")}, r"alpha must be a finite number > 1"),
        ({"pool_kernel": 2}, r"pool_kernel must be an odd integer >= 1"),
        ({"pool_kernel": 0}, r"pool_kernel must be an odd integer >= 1"),
        ({"budget": 0}, r"budget must be None \(dynamic, Eq. 4\) or an integer >= 1"),
        ({"delayed_cache": 1}, r"delayed_cache must be a bool"),
    ],
)
def test_bad_knobs_are_refused(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FocusConfig(**knobs)


def test_settings_names_and_unknown_knobs() -> None:
    assert FocusConfig.from_settings({"focus_alpha": 1.8, "focus_budget": None}) == FocusConfig(alpha=1.8)
    with pytest.raises(ValueError, match=r"unknown focus knobs \['focus_alpha_'\]"):
        FocusConfig.from_settings({"focus_alpha_": 2.0})


def test_unsupported_families_are_refused() -> None:
    gen = _gen(8, 8, 4, None)
    with pytest.raises(ValueError, match="runs block by block over the exact cache"):
        FocusLogits(tiny_model("sdar", num_layers=4), *_pair(gen), 3, gen, PAPER, DenseAttention())
    with pytest.raises(ValueError, match="block-diffusion decoding runs on SDAR models; 'dream'"):
        generate_focus_block_diffusion(_model("dream"), torch.tensor(PROMPTS[0]), gen, PAPER)
    with pytest.raises(ValueError, match="needs a model of >= 2 layers"):
        generate_focus_batched(tiny_model("llada", num_layers=1), PROMPTS[:1], gen, PAPER)


def _pair(gen: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    local = torch.tensor([1, 2, 3] + [96] * gen.gen_length)
    return local, torch.arange(local.numel())[None]


def test_sampler_chooses_among_eligible_rows_only() -> None:
    mask = 96
    conf = torch.tensor([0.9, 0.2, 0.8, 0.1])
    tokens = torch.tensor([5, 6, 7, 8])
    eligible = torch.tensor([False, True, True, True])
    state = DenoiseState(_gen(4, 2, None, None), mask, None)
    assert state.quota() == 2
    assert state.apply(tokens, conf, eligible).tolist() == [2, 1]  # not 0, the most confident
    state = DenoiseState(_gen(4, 4, None, 0.5), mask, None)
    assert state.quota() is None and state.apply(tokens, conf, eligible).tolist() == [2]
    state = DenoiseState(_gen(4, 4, None, 0.95), mask, None)
    assert state.apply(tokens, conf, eligible).tolist() == [2]  # the fallback argmax skips row 0
    state = DenoiseState(_gen(4, 1, None, None), mask, None)  # one step: the last, all eligible rows
    assert state.apply(tokens, conf, eligible).tolist() == [2, 1, 3] and not state.done
    assert state.apply(tokens[:1], conf[:1]).tolist() == [0] and state.done  # the extra step acts as last
    with pytest.raises(ValueError, match="eligible must mark >= 1"):
        DenoiseState(_gen(4, 4, None, None), mask, None).apply(tokens, conf, torch.zeros(4, dtype=torch.bool))
    logits = F.one_hot(torch.tensor([1, 2, 3, 4]), 97).float()
    assert DenoiseState(_gen(4, 4, None, None), mask, None).update(logits, eligible).numel() == 1
