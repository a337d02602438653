"""Decode policies over gRPC (`serve --role all` in process): a request's `decode_policy` runs in the decode
worker's batched rounds, and its answer equals the
in-process engine's (`engine.generate(..., decode_policy=...)`, `generate_vanilla(policy=...)`) token for
token; the trace names the policy with its counters; `serve --decode-policy` is the default of requests
that name none; bad knobs are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import InvalidRequestError
from tests.reference.vanilla import generate_vanilla

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .test_all_in_one import CONTEXT, QUESTION, serve_all

GEN = {"gen_length": 12, "steps": 12, "block_length": 4}
METHOD = {"chunk_size": 32, "top_k": 2}
# (wire settings, the DecodePolicyConfig the engine runs)
POLICIES = [
    ({"decode_policy": "prefix-cache"}, DecodePolicyConfig("prefix-cache")),
    ({"decode_policy": "dual-cache", "cache_refresh_steps": 2}, DecodePolicyConfig("dual-cache", 2)),
    (
        {"decode_policy": "sparse-dllm", "sparse_retention": 0.5, "sparse_delay_steps": 0},
        DecodePolicyConfig("sparse-dllm", retention=0.5, delay_steps=0),
    ),
    (  # updates every step (threshold 0), so its recompute counters are not zero
        {
            "decode_policy": "polestar",
            **(knobs := {"polestar_clusters": 2, "polestar_top_clusters": 1, "polestar_update_threshold": 0}),
        },
        DecodePolicyConfig("polestar", polestar=knobs),
    ),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def deployment(tiny_dir):
    dep = serve_all(tiny_dir)
    yield dep
    dep.stop()


def _engine_answer(loaded, kv_mode: str, policy: DecodePolicyConfig | None) -> GenerationResult:
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(**METHOD, kv_mode=kv_mode))
    result, _ = engine.generate(ids.context, ids.query, GenerationConfig(**GEN), decode_policy=policy)
    return result


def _ask(address: str, **values: Any):
    with PdllmClient(address) as client:
        return client.generate(context=CONTEXT, question=QUESTION, **GEN, **values)


def _trace_counters(response) -> dict[str, Any]:
    p = response.trace.decode_policy
    names = ("policy", "forwards", "refreshes", "rows_forwarded", "cache_bytes", "updates", "rows_recomputed")
    return {name: getattr(p, name) for name in names}


@pytest.mark.parametrize(("wire", "policy"), POLICIES, ids=[p.name for _, p in POLICIES])
@pytest.mark.parametrize("kv_mode", ["full-mask", "chunk-only"])
def test_pdllm_with_a_policy_equals_the_engine(deployment, loaded, wire, policy, kv_mode: str) -> None:
    response = _ask(deployment.address, **METHOD, kv_mode=kv_mode, **wire)
    expected = _engine_answer(loaded, kv_mode, policy)
    assert list(response.token_ids) == expected.token_ids
    assert _trace_counters(response) == expected.cache  # the policy that ran and what it saved
    recomputes = policy.name == "polestar"  # the only policy here that recomputes cached rows
    assert (response.trace.decode_policy.rows_recomputed > 0) == recomputes
    assert response.trace.method == "pdllm" and len(response.trace.selected_chunk_ids) == 2


def test_vanilla_with_dual_cache_equals_the_library(deployment, loaded) -> None:
    response = _ask(deployment.address, method="vanilla", decode_policy="dual-cache")
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    prompt = ids.vanilla(loaded.config.bos_token_id)
    expected = generate_vanilla(
        loaded.model, prompt, GenerationConfig(**GEN), policy=DecodePolicyConfig("dual-cache")
    )
    assert list(response.token_ids) == expected.token_ids
    assert _trace_counters(response) == expected.cache and expected.cache["refreshes"] == 3


def test_no_policy_is_named_none_in_the_trace(deployment) -> None:
    trace = _ask(deployment.address, **METHOD).trace
    assert trace.decode_policy.policy == "none" and trace.decode_policy.forwards == 0


def test_decode_interleave_with_batched_rounds(deployment, loaded) -> None:
    """Policy requests decode beside plain ones (batched) and each other, every answer unchanged."""
    asks = [{}, {"decode_policy": "dual-cache"}, {}, {"decode_policy": "sparse-dllm"}] * 2
    with ThreadPoolExecutor(len(asks)) as pool:
        responses = list(pool.map(lambda values: _ask(deployment.address, **METHOD, **values), asks))
    plain = _engine_answer(loaded, "full-mask", None).token_ids
    dual = _engine_answer(loaded, "full-mask", DecodePolicyConfig("dual-cache")).token_ids
    sparse = _engine_answer(loaded, "full-mask", DecodePolicyConfig("sparse-dllm")).token_ids
    expected = {"none": plain, "dual-cache": dual, "sparse-dllm": sparse}
    for values, response in zip(asks, responses, strict=True):
        name = values.get("decode_policy", "none")
        assert response.trace.decode_policy.policy == name
        assert list(response.token_ids) == expected[name], name


def test_stream_of_a_policy_request(deployment, loaded) -> None:
    with PdllmClient(deployment.address) as client:
        events = list(
            client.generate_stream(
                context=CONTEXT, question=QUESTION, **GEN, **METHOD, decode_policy="prefix-cache"
            )
        )
    partials = [e.partial for e in events if e.HasField("partial")]
    (final,) = [e.final for e in events if e.HasField("final")]
    unmasked = [p.unmasked for p in partials]
    assert len(partials) == 12 and unmasked == sorted(unmasked) and unmasked[-1] == 12
    assert (
        list(final.token_ids)
        == _engine_answer(loaded, "full-mask", DecodePolicyConfig("prefix-cache")).token_ids
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"decode_policy": "lru-cache"}, "decode_policy.decode_policy must be one of none, prefix-cache"),
        (
            {"decode_policy": "polestar", "polestar_clusters": 0},
            "decode_policy.polestar_clusters must be in [1, 1024] (got 0)",
        ),
        (
            {"decode_policy": "polestar", "polestar_clusters": 2, "polestar_top_clusters": 3},
            "decode_policy.polestar_top_clusters must be in [1, 2], at most decode_policy.polestar_clusters",
        ),
        (
            {"decode_policy": "dual-cache", "polestar_update_threshold": 2},
            "decode_policy.polestar_update_threshold needs decode_policy.decode_policy polestar",
        ),
        (
            {"decode_policy": "sparse-dllm", "sparse_retention": 1.5},
            "decode_policy.sparse_retention must be in (0, 1] (got 1.5)",
        ),
        ({"sparse_retention": 0.5}, "decode_policy.sparse_retention needs decode_policy.decode_policy"),
    ],
)
def test_bad_knobs_are_invalid_argument(deployment, values: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _ask(deployment.address, **METHOD, **values)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.message


def test_serve_flag_is_the_default_of_requests_that_name_none(tiny_dir, loaded) -> None:
    dep = serve_all(tiny_dir, "--decode-policy", "dual-cache", "--cache-refresh-steps", "2")
    try:
        default = _ask(dep.address, **METHOD)
        named = _ask(dep.address, **METHOD, decode_policy="none")
    finally:
        dep.stop()
    expected = _engine_answer(loaded, "full-mask", DecodePolicyConfig("dual-cache", 2))
    assert list(default.token_ids) == expected.token_ids and _trace_counters(default) == expected.cache
    assert named.trace.decode_policy.policy == "none"


def test_serve_refuses_a_bad_policy_flag(tiny_dir) -> None:
    with pytest.raises(ValueError, match=r"^--sparse-retention needs --decode-policy sparse-dllm, not none$"):
        serve_all(tiny_dir, "--sparse-retention", "0.5")
