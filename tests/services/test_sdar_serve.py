"""A tiny SDAR (block-diffusion) checkpoint through `serve --role all`.

Over gRPC a pdllm request's answer equals `pdllm generate --method pdllm` in process (same settings, same
seed) token for token, a vanilla one equals `generate --method vanilla` (block diffusion over the whole
prompt); under decode policy focus both equal their in-process FOCUS decodes and the trace carries FOCUS's
counters; what the SDAR decode does not run is INVALID_ARGUMENT naming the option, and the worker-level
flags it does not run are refused at startup.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdllm.decode_service.block_diffusion import answer_spans
from pdllm.shared.app.cli import main as cli_main
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import split_context
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import InvalidRequestError
from tests.reference.vanilla import generate_vanilla

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .test_all_in_one import CONTEXT, QUESTION, serve_all

# (wire / CLI settings): chunk size, top-K, kv mode, generation; the model's block size is 4.
CASES = [
    {"chunk_size": 16, "top_k": 2, "kv_mode": "full-mask", "gen_length": 8, "steps": 8, "block_length": 4},
    {"chunk_size": 16, "top_k": 3, "kv_mode": "chunk-query", "gen_length": 12, "steps": 6, "block_length": 4},
    {
        "chunk_size": 32,
        "top_k": 1,
        "kv_mode": "full-mask",
        "gen_length": 16,
        "steps": 16,
        "block_length": 8,
        "temperature": 0.8,
        "seed": 7,
    },
]


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")


@pytest.fixture(scope="module")
def loaded(sdar_dir):
    return load_model(sdar_dir)


@pytest.fixture(scope="module")
def deployment(sdar_dir):
    dep = serve_all(sdar_dir)
    yield dep
    dep.stop()


def _ask(address: str, **values: Any):
    with PdllmClient(address, timeout_s=120) as client:
        return client.generate(context=CONTEXT, question=QUESTION, **values)


def _gen(case: dict) -> GenerationConfig:
    keys = ("gen_length", "steps", "block_length", "temperature", "seed")
    return GenerationConfig(**{k: case[k] for k in keys if k in case})


@pytest.mark.parametrize("case", CASES, ids=["k2-g8-b4", "k3-g12-b4-query", "k1-g16-b8-sampled"])
def test_pdllm_answer_equals_generate_in_process(deployment, sdar_dir, loaded, case: dict, capsys) -> None:
    response = _ask(deployment.address, **case)
    # What `generate --method pdllm` runs: the engine, same settings (tokens) ...
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    method = {k: case[k] for k in ("chunk_size", "top_k", "kv_mode")}
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(**method))
    expected, trace = engine.generate(ids.context, ids.query, _gen(case))
    assert list(response.token_ids) == expected.token_ids and response.trace.steps == expected.steps
    assert list(response.trace.selected_chunk_ids) == trace.selected and len(trace.selected) == case["top_k"]
    # ... and the command itself (its answer text and selection).
    out = json.loads(_run_cli(sdar_dir, case, "pdllm", capsys))
    assert out["trace"]["selected_chunk_ids"] == trace.selected
    assert out["text"] == loaded.tokenizer.decode(list(response.token_ids), skip_special_tokens=True).strip()


def _run_cli(sdar_dir, case: dict, method: str, capsys) -> str:
    argv = ["generate", "--model", str(sdar_dir), "--context", CONTEXT, "--question", QUESTION]
    argv += ["--method", method, "--json"]
    for key, value in case.items():
        if method == "vanilla" and key in ("chunk_size", "top_k", "kv_mode"):
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    capsys.readouterr()  # what the test printed so far
    rc = cli_main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out


def test_vanilla_answer_equals_generate_vanilla(deployment, sdar_dir, loaded, capsys) -> None:
    case = {"gen_length": 12, "steps": 12, "block_length": 4, "temperature": 0.5, "seed": 3}
    response = _ask(deployment.address, method="vanilla", **case)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    expected = generate_vanilla(loaded.model, ids.vanilla(loaded.config.bos_token_id), _gen(case))
    assert list(response.token_ids) == expected.token_ids and response.trace.steps == expected.steps
    out = json.loads(_run_cli(sdar_dir, case, "vanilla", capsys))
    assert out["text"] == loaded.tokenizer.decode(list(response.token_ids), skip_special_tokens=True).strip()


def test_stream_partials_name_the_aligned_blocks(deployment, loaded) -> None:
    gen = {"gen_length": 16, "steps": 16, "block_length": 8}
    with PdllmClient(deployment.address, timeout_s=120) as client:
        events = list(
            client.generate_stream(context=CONTEXT, question=QUESTION, chunk_size=16, top_k=2, **gen)
        )
    partials = [e.partial for e in events if e.HasField("partial")]
    (final,) = [e.final for e in events if e.HasField("final")]
    assert len(partials) == final.trace.steps == 16
    unmasked = [p.unmasked for p in partials]
    assert unmasked == sorted(unmasked) and unmasked[-1] == 16
    # Blocks aligned to absolute positions: the first and last answer blocks may be partial, so there may
    # be one block more than gen_length / block_length; every partial names one of them.
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    chunks = split_context(list(ids.context), 16)
    selected = sum(len(chunks[i]) + 1 for i in final.trace.selected_chunk_ids)  # each with its BOS
    spans = answer_spans(len(ids.instruction) + selected + len(ids.query), 16, 8)
    assert len(spans) == 3  # the prompt ends mid block: 16 answer tokens over 3 aligned blocks
    blocks = [p.block_index for p in partials]
    assert blocks == sorted(blocks) and set(blocks) == {0, 1, 2}


# (wire decode policy, the DecodePolicyConfig it is, generation): FOCUS's defaults and some knobs set.
FOCUS = [
    ({"decode_policy": "focus"}, {}, {"gen_length": 12, "steps": 12, "block_length": 4}),
    (
        {"decode_policy": "focus", **(f := {"focus_budget": 2, "focus_delayed_cache": "off"})},
        f,
        {"gen_length": 16, "steps": 8, "block_length": 8, "temperature": 0.7, "seed": 3},
    ),
    (
        {"decode_policy": "focus", **(f := {"focus_alpha": 1.2, "focus_pool_kernel": 5})},
        f,
        {"gen_length": 16, "steps": 16, "block_length": 4, "threshold": 0.1},
    ),
]
FOCUS_IDS = ["paper-g12-b4", "b2-nocache-g16-b8-sampled", "alpha-k5-threshold"]


def _counters(response) -> dict[str, Any]:
    """The trace's policy name and nonzero counters, like ``GenerationResult.cache``'s nonzero entries (a
    proto3 scalar does not tell 0 from unset)."""
    p = response.trace.decode_policy
    named = {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if f.name != "counters"}
    return {k: v for k, v in {**named, **dict(p.counters)}.items() if v}


@pytest.mark.parametrize(("wire", "knobs", "gen"), FOCUS, ids=FOCUS_IDS)
def test_vanilla_focus_equals_generate_vanilla(
    deployment, loaded, wire: dict, knobs: dict, gen: dict
) -> None:
    response = _ask(deployment.address, method="vanilla", **gen, **wire)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    policy = DecodePolicyConfig("focus", focus=knobs)
    prompt = ids.vanilla(loaded.config.bos_token_id)
    expected = generate_vanilla(loaded.model, prompt, GenerationConfig(**gen), policy=policy)
    assert list(response.token_ids) == expected.token_ids and response.trace.steps == expected.steps
    assert expected.cache["policy"] == "focus" and expected.cache["forwards"] == expected.steps
    assert _counters(response) == {k: v for k, v in expected.cache.items() if v}


@pytest.mark.parametrize(("wire", "knobs", "gen"), FOCUS, ids=FOCUS_IDS)
def test_pdllm_focus_equals_the_engine(deployment, loaded, wire: dict, knobs: dict, gen: dict) -> None:
    method = {"chunk_size": 16, "top_k": 2, "kv_mode": "chunk-query"}
    response = _ask(deployment.address, **method, **gen, **wire)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(**method))
    policy = DecodePolicyConfig("focus", focus=knobs)
    expected, trace = engine.generate(ids.context, ids.query, GenerationConfig(**gen), decode_policy=policy)
    assert list(response.token_ids) == expected.token_ids and response.trace.steps == expected.steps
    assert list(response.trace.selected_chunk_ids) == trace.selected
    assert expected.cache["policy"] == "focus" and expected.cache["forwards"] == expected.steps
    assert _counters(response) == {k: v for k, v in expected.cache.items() if v}


def test_concurrent_focus_requests_share_rounds(deployment, loaded, focus_round_sizes) -> None:
    """SDAR FOCUS requests in flight together (vanilla and pdllm) advance in the scheduler's one batched
    round per iteration (``decode_service/sdar_focus_rounds.py``) and each answers as in process."""

    gen = {"gen_length": 12, "steps": 12, "block_length": 4}
    method = {"chunk_size": 16, "top_k": 2, "kv_mode": "chunk-query"}
    asks = [method, {"method": "vanilla"}, method]
    with ThreadPoolExecutor(len(asks)) as pool:
        responses = list(
            pool.map(lambda v: _ask(deployment.address, decode_policy="focus", **gen, **v), asks)
        )
    ids, policy = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION), DecodePolicyConfig("focus")
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(**method))
    pdllm, _ = engine.generate(ids.context, ids.query, GenerationConfig(**gen), decode_policy=policy)
    prompt = ids.vanilla(loaded.config.bos_token_id)
    vanilla = generate_vanilla(loaded.model, prompt, GenerationConfig(**gen), policy=policy)
    assert [list(r.token_ids) for r in responses] == [pdllm.token_ids, vanilla.token_ids, pdllm.token_ids]
    assert max(focus_round_sizes) >= 2  # some round advanced several FOCUS requests at once


def test_serve_decode_policy_focus_is_the_default_policy(sdar_dir, loaded) -> None:
    """``serve --decode-policy focus`` starts on SDAR; a request naming no policy is decoded under it."""
    dep = serve_all(sdar_dir, "--decode-policy", "focus")
    try:
        gen = {"gen_length": 8, "steps": 8, "block_length": 4}
        response = _ask(dep.address, method="vanilla", **gen)
    finally:
        dep.stop()
    prompt = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION).vanilla(loaded.config.bos_token_id)
    expected = generate_vanilla(
        loaded.model, prompt, GenerationConfig(**gen), policy=DecodePolicyConfig("focus")
    )
    assert list(response.token_ids) == expected.token_ids
    assert _counters(response) == {k: v for k, v in expected.cache.items() if v}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kv_mode": "chunk-only"}, "kv_mode='chunk-only' is not supported"),
        ({"top_b": 4}, "top_b=4 is not supported"),
        ({"decode_policy": "dual-cache"}, "decode_policy 'dual-cache' is not supported"),
        ({"decode_policy": "dyllm"}, "decode_policy 'dyllm' is not supported"),
        ({"method": "vanilla", "decode_policy": "dyllm"}, "decode_policy 'dyllm' is not supported"),
        (
            {"method": "vanilla", "decode_policy": "prefix-cache"},
            "decode_policy 'prefix-cache' is not supported",
        ),
        ({"method": "vanilla", "decode_policy": "dual-cache"}, "decode_policy 'dual-cache' is not supported"),
        ({"gen_length": 12, "steps": 12, "block_length": 6}, "block_length is 6"),
    ],
)
def test_unsupported_options_are_invalid_argument(deployment, values: dict, message: str) -> None:
    request = {"chunk_size": 16, "top_k": 2, "gen_length": 8, "steps": 8, "block_length": 4} | values
    with pytest.raises(InvalidRequestError) as info:
        _ask(deployment.address, **request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.message and "SDAR" in info.value.message


@pytest.mark.parametrize(
    ("flags", "engine", "message"),
    [
        (["--cuda-graph"], {}, "--cuda-graph is not supported on SDAR"),
        (["--decode-policy", "dual-cache"], {}, "--decode-policy dual-cache is not supported on SDAR"),
        (["--decode-policy", "dyllm"], {}, "--decode-policy dyllm is not supported on SDAR"),
        # The checkpoint's engine defaults (pdllm.json) are the worker's: the engine refuses them.
        ([], {"kv_mode": "chunk-only"}, "kv_mode='chunk-only' is not supported by the pdllm engine on SDAR"),
        ([], {"top_b": 4}, "top_b=4 is not supported by the pdllm engine on SDAR"),
    ],
)
def test_worker_level_settings_are_refused_at_startup(
    sdar_dir, tmp_path, flags: list[str], engine: dict, message: str
) -> None:
    model = sdar_dir
    if engine:
        model = tmp_path / "sdar"
        shutil.copytree(sdar_dir, model)
        (model / "pdllm.json").write_text(json.dumps({"engine": engine}))
    with pytest.raises(ValueError, match=message):
        serve_all(model, *flags)
