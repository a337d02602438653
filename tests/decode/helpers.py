"""Sessions for the batched-round and scheduler tests: tiny random models, each case also run alone."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.policies import DecodePolicyConfig, make_policy
from pdllm.decode_service.policy_rounds import PolicyBatchSession, batch_session, cache_slots
from pdllm.decode_service.request import DecodeRequest, StaticDecode
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward, RoundForward, decode_round
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.prefill_service.worker import Selection
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.transformer import DiffusionLM
from tests.engine.helpers import tokens
from tests.model.helpers import tiny_model
from tests.reference.policy import run_policy
from tests.reference.static_kv import StaticPolicy, decode, static_policy_logits


@dataclass(frozen=True)
class Case:
    config: EngineConfig
    gen: GenerationConfig
    context: int
    question: int
    instruction: tuple[int, ...] = ()


# Mixed context lengths, K, top-B, KV modes, gen lengths, blocks, thresholds, temperatures with seeds.
CASES = [
    Case(EngineConfig(chunk_size=12, top_k=2), GenerationConfig(gen_length=6, steps=3), 40, 5),
    Case(
        EngineConfig(chunk_size=8, top_k=3, top_b=5),
        GenerationConfig(gen_length=8, steps=8, block_length=4),
        70,
        3,
        (7, 8),
    ),
    Case(
        EngineConfig(chunk_size=16, top_k=1, kv_mode="chunk-only"),
        GenerationConfig(gen_length=4, steps=4, temperature=0.8, seed=3),
        30,
        7,
    ),
    Case(
        EngineConfig(chunk_size=10, top_k=2, kv_mode="chunk-query"),
        GenerationConfig(gen_length=10, steps=10, threshold=0.3),
        50,
        4,
    ),
    Case(
        EngineConfig(chunk_size=20, top_k=4, top_b=9, kv_mode="chunk-only"),
        GenerationConfig(gen_length=12, steps=6, block_length=6, temperature=1.3, seed=11),
        90,
        2,
    ),
]


def prefill(m: DiffusionLM, case: Case, seed: int) -> tuple[PrefillingEngine, Selection]:
    engine = PrefillingEngine(m, None, case.config, reuse_chunks=False)
    return engine, engine.prefill(
        tokens(case.context, seed), tokens(case.question, 100 + seed), case.gen, list(case.instruction)
    )


def alone(m: DiffusionLM, case: Case, seed: int) -> list[int]:
    """The case decoded on its own by the reference loop (segmented attention, no scheduler): the
    specification."""
    engine, sel = prefill(m, case, seed)
    static = engine.build(sel, case.gen)
    return decode(m, sel.request.query, static, case.gen, StaticPolicy("segments")).raw_tokens


def static_decode(m: DiffusionLM, case: Case, seed: int) -> StaticDecode:
    engine, sel = prefill(m, case, seed)
    return StaticDecode(sel.request.query, engine.build(sel, case.gen), case.gen)


def session(
    m: DiffusionLM, pool: DecodeKVPool, case: Case, seed: int, device_sampler: bool = True
) -> BatchSession:
    built = static_decode(m, case, seed)
    pages = pool.reserve(built.static.num_tokens)
    assert pages is not None
    pool.write(pages, built.static.tensor())
    s = built.static
    return BatchSession.start(
        m, built.query, s.query_start, s.num_tokens, pages, case.gen, device_sampler=device_sampler
    )


def eos_model(family: str) -> DiffusionLM:
    """A tiny model whose LM head makes EOS the prediction at some response positions (so requests stop
    early): EOS's row is a scaled copy of a token's row that wins at some of them."""
    m = tiny_model(family)
    with torch.no_grad():
        m.lm_head.weight[m.config.eos_token_id] = m.lm_head.weight[50 if family == "dream" else 70] * 1.3
    return m


def pool_for(m: DiffusionLM, pages: int = 64, page_size: int = 16) -> DecodeKVPool:
    return DecodeKVPool.with_pages(m, pages, page_size)


def random_static(m: DiffusionLM, n: int, seed: int) -> torch.Tensor:
    c = m.config
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(c.num_layers, 2, c.num_kv_heads, n, c.head_dim, generator=gen)


def round_forward(kind: str, m: DiffusionLM, pool: DecodeKVPool) -> RoundForward:
    """``eager``: op by op; ``padded``: the graph buckets' padded buffers, run eagerly (CPU)."""
    if kind == "eager":
        return EagerRoundForward(m, pool, "torch")
    return GraphedRoundForward(m, pool, "torch", capture=False)


def run_rounds(forward: RoundForward, sessions: list[BatchSession]) -> int:
    """Sessions join one per round and leave when done, so rounds mix sessions at different steps;
    returns the number of rounds."""
    active: list[BatchSession] = []
    waiting, rounds = list(sessions), 0
    while active or waiting:
        if waiting:
            active.append(waiting.pop(0))
        decode_round(forward, active)
        rounds += 1
        active = [s for s in active if not s.done]
    return rounds


# Several blocks in every case, so refreshes and cached steps alternate.
POLICY_CASES = [
    replace(CASES[0], gen=GenerationConfig(gen_length=8, steps=8, block_length=4)),
    CASES[1],
    replace(CASES[2], gen=GenerationConfig(gen_length=8, steps=8, block_length=2, temperature=0.8, seed=3)),
    replace(CASES[3], gen=GenerationConfig(gen_length=10, steps=10, block_length=5, threshold=0.3)),
    CASES[4],
]


def reference(m: DiffusionLM, case: Case, seed: int, policy: DecodePolicyConfig) -> tuple[list[int], dict]:
    """The policy's eager reference loop (``PolicyLogits`` over the static KV, no scheduler): the
    specification."""
    engine, sel = prefill(m, case, seed)
    cache_policy = make_policy(policy)
    assert cache_policy is not None
    static = engine.build(sel, case.gen)
    result = run_policy(
        static_policy_logits(m, sel.request.query, static, case.gen, cache_policy, "segments")
    )
    return result.raw_tokens, dict(result.cache)


def policy_session(
    m: DiffusionLM, pool: DecodeKVPool, case: Case, seed: int, policy: DecodePolicyConfig, device_sampler=True
) -> PolicyBatchSession:
    """The case's session in the rounds under ``policy`` (its batched kind: ``batch_session``)."""
    built = static_decode(m, case, seed)
    s = built.static
    cache_policy = make_policy(policy)
    assert cache_policy is not None
    pages = pool.reserve(
        s.num_tokens + cache_slots(len(built.query), case.gen, cache_policy, len(built.query))
    )
    assert pages is not None
    pool.write(pages, s.tensor())
    built = replace(built, cache_policy=cache_policy)
    out = batch_session(m, built, pages, pool.page_size, device_sampler)
    assert isinstance(out, PolicyBatchSession)
    return out


class Forwards:
    """Counts the model's forwards (its embedding's calls)."""

    def __init__(self, m: DiffusionLM) -> None:
        self.n = 0
        m.model.embed_tokens.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))


def rounds_with_arrivals(
    m: DiffusionLM,
    forward: RoundForward,
    order: list[BatchSession],
    kind: type[BatchSession],
    others: int = 1,
) -> int:
    """Decode ``order`` to the end, one arrival per round (sessions join in the middle of others'
    blocks), asserting one model forward per round; returns the rounds where a ``kind`` session shared
    the forward with more than ``others`` other sessions."""
    order, forwards, active, mixed = list(order), Forwards(m), [], 0
    while order or active:
        if order:
            active.append(order.pop(0))
        before = forwards.n
        decode_round(forward, active)
        assert forwards.n == before + 1  # one model forward per round
        mixed += any(isinstance(s, kind) for s in active) and len(active) > others
        active = [s for s in active if not s.done]
    return mixed


def schedule_arrivals(m: DiffusionLM, sched: DecodeScheduler, arrivals: dict[int, DecodeRequest]) -> None:
    """Submit ``arrivals`` (iteration -> request) while the scheduler runs, until every request is done;
    every iteration runs exactly one round, one model forward (builds are not model forwards here)."""
    forwards, iteration = Forwards(m), 0
    while iteration <= max(arrivals) or sched.depth:
        if iteration in arrivals:
            sched.submit(arrivals[iteration])
        before, rounds = forwards.n, sched.rounds
        sched.run_once()
        iteration += 1
        assert forwards.n - before == sched.rounds - rounds == 1
