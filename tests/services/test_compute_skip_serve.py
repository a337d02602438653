"""DyLLM and FOCUS (the compute-skipping decode policies) over gRPC
(`serve --role all` in process): a request naming one rides in the decode worker's batched rounds, and its answer equals the in-process engine's / ``generate_vanilla``'s
token for token; the trace names the policy and carries its counters (``DecodePolicyTrace.counters``); bad
knobs are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.errors import InvalidRequestError
from tests.reference.vanilla import generate_vanilla

from .test_all_in_one import CONTEXT, QUESTION
from .test_decode_policy_serve import GEN, METHOD, _ask, _engine_answer, deployment, loaded, tiny_dir  # noqa: F401

# (wire settings, the DecodePolicyConfig the engine runs): the paper's defaults and some knobs set.
POLICIES = [
    ({"decode_policy": "dyllm"}, DecodePolicyConfig("dyllm")),
    (
        {"decode_policy": "dyllm", **(d := {"dyllm_threshold": 0.9, "dyllm_full_steps": 2})},
        DecodePolicyConfig("dyllm", dyllm=d),
    ),
    ({"decode_policy": "focus"}, DecodePolicyConfig("focus")),
    (
        {"decode_policy": "focus", **(f := {"focus_budget": 2, "focus_delayed_cache": "off"})},
        DecodePolicyConfig("focus", focus=f),
    ),
]
IDS = ["dyllm", "dyllm-knobs", "focus", "focus-knobs"]


def _counters(response) -> dict[str, Any]:
    """The trace's policy name and nonzero counters, as one dict like ``GenerationResult.cache``'s (a proto3
    scalar does not tell 0 from unset)."""
    p = response.trace.decode_policy
    named = {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if f.name != "counters"}
    return _nonzero({**named, **dict(p.counters)})


def _nonzero(cache: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cache.items() if v}


@pytest.mark.parametrize(("wire", "policy"), POLICIES, ids=IDS)
def test_pdllm_with_a_compute_skipping_policy_equals_the_engine(deployment, loaded, wire, policy) -> None:  # noqa: F811
    response = _ask(deployment.address, **METHOD, kv_mode="full-mask", **wire)
    expected = _engine_answer(loaded, "full-mask", policy)
    assert list(response.token_ids) == expected.token_ids
    assert _counters(response) == _nonzero(expected.cache) and expected.cache["policy"] == policy.name
    assert response.trace.method == "pdllm" and len(response.trace.selected_chunk_ids) == 2


@pytest.mark.parametrize(("wire", "policy"), POLICIES, ids=IDS)
def test_vanilla_with_a_compute_skipping_policy_equals_the_library(deployment, loaded, wire, policy) -> None:  # noqa: F811
    response = _ask(deployment.address, method="vanilla", **wire)
    prompt = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION).vanilla(loaded.config.bos_token_id)
    expected = generate_vanilla(loaded.model, prompt, GenerationConfig(**GEN), policy=policy)
    assert list(response.token_ids) == expected.token_ids
    assert _counters(response) == _nonzero(expected.cache)
    # What plain decoding computes bounds what the policy did (FOCUS counts layers >= 2: none on this
    # 2-layer checkpoint, which still exercises its selection and eligible rows).
    trace = response.trace.decode_policy
    plain = "rows_total" if policy.name == "dyllm" else "rows_plain"
    assert trace.counters[plain] >= trace.rows_forwarded and trace.forwards == GEN["steps"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"decode_policy": "dyllm", "dyllm_threshold": 0.0},
            "decode_policy.dyllm_threshold must be in (0, 1] (got 0.0)",
        ),
        (
            {"decode_policy": "dyllm", "dyllm_approximate_attention": "maybe"},
            "decode_policy.dyllm_approximate_attention must be one of on, off (got 'maybe')",
        ),
        (
            {"decode_policy": "focus", "focus_alpha": 1.0},
            "decode_policy.focus_alpha must be in (1, 64] (got 1.0)",
        ),
        (
            {"decode_policy": "focus", "focus_pool_kernel": 2},
            "decode_policy.focus_pool_kernel must be odd (got 2)",
        ),
        (
            {"decode_policy": "dual-cache", "focus_budget": 2},
            "decode_policy.focus_budget needs decode_policy.decode_policy focus, not dual-cache",
        ),
        (
            {"decode_policy": "focus", "dyllm_full_steps": 2},
            "decode_policy.dyllm_full_steps needs decode_policy.decode_policy dyllm, not focus",
        ),
        (
            {"decode_policy": "dyllm", "cache_refresh_steps": 2},
            "decode_policy.cache_refresh_steps needs a caching decode_policy.decode_policy",
        ),
    ],
)
def test_bad_knobs_are_invalid_argument(deployment, values: dict, message: str) -> None:  # noqa: F811
    with pytest.raises(InvalidRequestError) as info:
        _ask(deployment.address, **METHOD, **values)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.message


def test_concurrent_focus_requests_share_rounds(deployment, loaded, focus_round_sizes) -> None:  # noqa: F811
    """FOCUS requests in flight together ride in the same batched rounds (``decode_service/focus_rounds.py``)
    and each still answers as the engine does (pdllm) and as the reference loop does (vanilla)."""

    asks = [{**METHOD, "kv_mode": "full-mask"}, {"method": "vanilla"}, {**METHOD, "kv_mode": "full-mask"}]
    with ThreadPoolExecutor(len(asks)) as pool:
        responses = list(pool.map(lambda v: _ask(deployment.address, decode_policy="focus", **v), asks))
    policy = DecodePolicyConfig("focus")
    pdllm = _engine_answer(loaded, "full-mask", policy).token_ids
    prompt = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION).vanilla(loaded.config.bos_token_id)
    vanilla = generate_vanilla(loaded.model, prompt, GenerationConfig(**GEN), policy=policy).token_ids
    assert [list(r.token_ids) for r in responses] == [pdllm, vanilla, pdllm]
    assert max(focus_round_sizes) >= 2  # some round advanced several FOCUS requests at once
