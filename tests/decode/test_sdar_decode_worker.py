"""The decode worker on SDAR (block diffusion): a pdllm request's job equals the in-process engine's decode
of the same selection token for token (its block-causal prefix rebuilt from the chunks' token ids, the
session in the batched rounds, one denoising step per scheduler iteration); a vanilla one equals block diffusion over
the whole prompt; under decode policy focus both equal their in-process FOCUS decodes, tokens and counters
(the trace's ``decode_policy``); what it does not run is INVALID_ARGUMENT naming the option, before any
work."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.server import DecodeServicer
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import decode_layout
from pdllm.shared.rpc.errors import PdllmError
from tests.decode.helpers import pool_for
from tests.engine.helpers import model, tokens
from tests.reference import sdar
from tests.reference.block_diffusion import generate_block_diffusion
from tests.reference.focus import generate_focus_block_diffusion

BOS = 1
# (seed, chunk size, K, instruction len, query len, generation); model block size 4.
CASES = [
    (0, 8, 2, 2, 4, GenerationConfig(gen_length=16, steps=16, block_length=4)),  # static 20, prompt 24
    (1, 8, 3, 3, 5, GenerationConfig(gen_length=16, steps=8, block_length=8)),  # static 30, prompt 35
    (2, 12, 1, 0, 3, GenerationConfig(gen_length=12, steps=12, block_length=12, temperature=0.9, seed=5)),
    (3, 8, 2, 1, 6, GenerationConfig(gen_length=8, steps=8, threshold=0.2)),  # one block of 8
]


def _reference(
    engine: PrefillingEngine, sel, gen: GenerationConfig, policy: DecodePolicyConfig | None = None
):  # type: ignore[no-untyped-def]
    """Steps 6-7 on SDAR by the reference loop (``tests/reference/sdar.py``), one request, no scheduler."""
    layout = decode_layout(sel.request, sel.selected, gen.gen_length)
    prefix = sdar_decode.build_prefix(engine.model, sel.request, layout, gen)
    return sdar.decode(engine.model, sel.request, layout, prefix, gen, False, policy)


class _Context:
    """What ``termination_event`` needs of a gRPC context: the call never ends early."""

    def add_callback(self, callback) -> bool:  # type: ignore[no-untyped-def]
        return True


def _generation(gen: GenerationConfig) -> wpb.DecodeRequest:
    request = wpb.DecodeRequest(request_id="r", stream_partials=True)
    request.generation.gen_length = gen.gen_length
    request.generation.steps = gen.steps
    if gen.block_length is not None:
        request.generation.block_length = gen.block_length
    if gen.threshold is not None:
        request.generation.threshold = gen.threshold
    request.generation.temperature = gen.temperature
    request.generation.seed = gen.seed
    return request


def _pdllm_request(instruction, chunks, query, gen: GenerationConfig, **method) -> wpb.DecodeRequest:  # type: ignore[no-untyped-def]
    request = _generation(gen)
    request.instruction_ids.extend(instruction)
    request.question_ids.extend(query)
    for i, chunk in enumerate(chunks):
        request.chunks.add(key=f"k{i}", chunk_id=i, token_ids=chunk)
    request.method.method = "pdllm"
    for name, value in method.items():
        setattr(request.method, name, value)
    return request


@pytest.fixture(scope="module")
def served():
    m = model("sdar")
    pool = pool_for(m)
    scheduler = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"))
    yield m, DecodeServicer(DecodeWorker(m), scheduler)
    scheduler.close()


def _decode(servicer: DecodeServicer, request: wpb.DecodeRequest) -> tuple[wpb.DecodeResult, list]:
    partials, final = [], None
    for response in servicer.Decode(request, _Context()):  # type: ignore[arg-type]
        if response.HasField("partial"):
            partials.append(response.partial)
        else:
            final = response.final
    assert final is not None
    return final, partials


@pytest.mark.parametrize(("seed", "chunk", "k", "instr", "query", "gen"), CASES)
def test_pdllm_job_equals_the_engine(
    served, seed: int, chunk: int, k: int, instr: int, query: int, gen
) -> None:
    m, servicer = served
    engine = PrefillingEngine(m, config=EngineConfig(chunk_size=chunk, top_k=k), reuse_chunks=False)
    context, question, instruction = tokens(40, seed), tokens(query, seed + 100), tokens(instr, seed + 200)
    sel = engine.prefill(context, question, gen, instruction)
    chunks = [sel.request.chunks[i] for i in sel.selected]  # what the router sends: the selected chunks
    assert all(c[0] == BOS for c in chunks) and len(chunks) == k
    final, partials = _decode(servicer, _pdllm_request(instruction, chunks, question, gen, top_k=k))
    expected = _reference(engine, sel, gen)
    assert list(final.token_ids) == expected.token_ids and final.steps == expected.steps
    assert final.kv_source == "built" and final.decode_policy.policy == "none"
    # One partial per denoising step (each a scheduler iteration), the last one the answer itself.
    assert len(partials) == expected.steps
    assert list(partials[-1].token_ids) == expected.raw_tokens


def test_vanilla_job_is_block_diffusion_over_the_prompt(served) -> None:
    m, servicer = served
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    context, question, instruction = tokens(19, 5), tokens(4, 6), tokens(2, 7)
    request = _generation(gen)
    request.method.method = "vanilla"
    request.instruction_ids.extend(instruction)
    request.context_ids.extend(context)
    request.question_ids.extend(question)
    final, _ = _decode(servicer, request)
    prompt = torch.tensor([BOS, *instruction, *context, *question])
    assert list(final.token_ids) == generate_block_diffusion(m, prompt, gen).token_ids


def _counters(final: wpb.DecodeResult) -> dict:
    """The trace's policy name and nonzero counters, like ``GenerationResult.cache``'s nonzero entries."""
    p = final.decode_policy
    named = {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if f.name != "counters"}
    return {k: v for k, v in {**named, **dict(p.counters)}.items() if v}


FOCUS = [
    ({}, CASES[0]),
    ({"focus_budget": 2, "focus_delayed_cache": "off"}, CASES[1]),
    ({"focus_alpha": 1.2, "focus_pool_kernel": 1}, CASES[2]),
]


@pytest.mark.parametrize(("knobs", "case"), FOCUS, ids=["paper", "b2-nocache", "alpha-k1-sampled"])
def test_focus_jobs_equal_in_process_focus(served, knobs: dict, case: tuple) -> None:
    m, servicer = served
    seed, chunk, k, instr, query, gen = case
    policy = DecodePolicyConfig("focus", focus=knobs)
    engine = PrefillingEngine(m, config=EngineConfig(chunk_size=chunk, top_k=k), reuse_chunks=False)
    context, question, instruction = tokens(40, seed), tokens(query, seed + 100), tokens(instr, seed + 200)
    sel = engine.prefill(context, question, gen, instruction)
    chunks = [sel.request.chunks[i] for i in sel.selected]
    request = _pdllm_request(instruction, chunks, question, gen, top_k=k)
    request.decode_policy.decode_policy = "focus"
    for name, value in knobs.items():
        setattr(request.decode_policy, name, value)
    final, partials = _decode(servicer, request)
    expected = _reference(engine, sel, gen, policy)
    assert list(final.token_ids) == expected.token_ids and final.steps == expected.steps
    assert list(partials[-1].token_ids) == expected.raw_tokens and len(partials) == expected.steps
    assert expected.cache["policy"] == "focus" and expected.cache["forwards"] == expected.steps
    assert _counters(final) == {k: v for k, v in expected.cache.items() if v}
    # vanilla: FOCUS over the whole prompt, as generate_vanilla runs it
    request = _generation(gen)
    request.method.method = "vanilla"
    request.instruction_ids.extend(instruction)
    request.context_ids.extend(context)
    request.question_ids.extend(question)
    request.decode_policy.decode_policy = "focus"
    for name, value in knobs.items():
        setattr(request.decode_policy, name, value)
    final, _ = _decode(servicer, request)
    prompt = torch.tensor([BOS, *instruction, *context, *question])
    vanilla = generate_focus_block_diffusion(m, prompt, gen, policy.focus_config())
    assert list(final.token_ids) == vanilla.token_ids and final.steps == vanilla.steps
    assert _counters(final) == {k: v for k, v in vanilla.cache.items() if v}


def test_concurrent_jobs_each_answer_exactly(served) -> None:
    """SDAR sessions share the scheduler's rounds, each answering as alone."""
    m, servicer = served
    engine = PrefillingEngine(m, config=EngineConfig(chunk_size=8, top_k=2), reuse_chunks=False)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    requests, expected = [], []
    for seed in range(3):
        context, question = tokens(40, seed + 10), tokens(3 + seed, seed + 20)
        sel = engine.prefill(context, question, gen)
        chunks = [sel.request.chunks[i] for i in sel.selected]
        requests.append(_pdllm_request([], chunks, question, gen))
        expected.append(_reference(engine, sel, gen).token_ids)
    with ThreadPoolExecutor(len(requests)) as pool:
        finals = list(pool.map(lambda r: _decode(servicer, r)[0], requests))
    assert [list(f.token_ids) for f in finals] == expected


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"kv_mode": "chunk-only"}, "kv_mode='chunk-only' is not supported"),
        ({"top_b": 3}, "top_b=3 is not supported"),
        (
            {"policy": "dual-cache"},
            "decode_policy 'dual-cache' is not supported by the decode worker on SDAR",
        ),
        ({"policy": "dyllm"}, "decode_policy 'dyllm' is not supported by the decode worker on SDAR"),
        ({"vanilla": True, "policy": "dyllm"}, "decode_policy 'dyllm' is not supported"),
        ({"vanilla": True, "policy": "dual-cache"}, "decode_policy 'dual-cache' is not supported"),
        ({"block_length": 6}, "block_length is 6, but this SDAR (block-diffusion) model has block size 4"),
    ],
)
def test_unsupported_options_are_invalid_argument_before_any_work(edit: dict, message: str) -> None:
    gen = GenerationConfig(gen_length=12, steps=12, block_length=edit.get("block_length", 4))
    request = _pdllm_request([7], [[BOS, 8, 9, 10]], [5, 6], gen)
    if "kv_mode" in edit:
        request.method.kv_mode = edit["kv_mode"]
    if "top_b" in edit:
        request.method.top_b = edit["top_b"]
    if "policy" in edit:
        request.decode_policy.decode_policy = edit["policy"]
    if edit.get("vanilla"):
        del request.chunks[:]
        request.context_ids.extend([8, 9, 10])
        request.method.method = "vanilla"
    # No scheduler: a request that got past the checks would fail on it with an AttributeError.
    servicer = DecodeServicer(DecodeWorker(model("sdar")), scheduler=None)  # type: ignore[arg-type]
    with pytest.raises(PdllmError) as err:
        next(servicer.Decode(request, context=None))  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message
