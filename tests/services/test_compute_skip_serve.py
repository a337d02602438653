"""DyLLM (a compute-skipping decode policy) over gRPC on a Dream checkpoint (`serve --role all` in
process): a request naming it rides in the decode worker's batched rounds, and its answer equals the
in-process engine's / ``generate_vanilla``'s token for token; the trace names the policy and carries its
counters (``DecodePolicyTrace.counters``); bad knobs are INVALID_ARGUMENT naming the field. FOCUS runs on
SDAR only (``test_sdar_serve.py``): a Dream request naming it is INVALID_ARGUMENT, and ``serve
--decode-policy focus`` on a Dream checkpoint is refused at startup."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.errors import InvalidRequestError
from tests.reference.vanilla import generate_vanilla

from .test_all_in_one import CONTEXT, QUESTION, serve_all
from .test_decode_policy_serve import GEN, METHOD, _ask, _engine_answer, deployment, loaded, tiny_dir  # noqa: F401

# (wire settings, the DecodePolicyConfig the engine runs): the paper's defaults and some knobs set.
POLICIES = [
    ({"decode_policy": "dyllm"}, DecodePolicyConfig("dyllm")),
    (
        {"decode_policy": "dyllm", **(d := {"dyllm_threshold": 0.9, "dyllm_full_steps": 2})},
        DecodePolicyConfig("dyllm", dyllm=d),
    ),
]
IDS = ["dyllm", "dyllm-knobs"]
ONLY_SDAR = (
    "decode policy 'focus' runs on block-diffusion (SDAR) models only; on Dream/LLaDA it measured no gain "
    "over plain decoding"
)


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
    # What plain decoding computes bounds what the policy did.
    trace = response.trace.decode_policy
    assert trace.counters["rows_total"] >= trace.rows_forwarded and trace.forwards == GEN["steps"]


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


@pytest.mark.parametrize(
    "values",
    [
        {**METHOD, "kv_mode": "full-mask", "decode_policy": "focus"},
        {"method": "vanilla", "decode_policy": "focus"},
        {"method": "vanilla", "decode_policy": "focus", "focus_budget": 2},
    ],
    ids=["pdllm", "vanilla", "vanilla-knobs"],
)
def test_focus_on_dream_is_invalid_argument(deployment, values: dict) -> None:  # noqa: F811
    """FOCUS runs on SDAR only: a Dream request naming it is refused before it is scheduled, one line."""
    with pytest.raises(InvalidRequestError) as info:
        _ask(deployment.address, **values)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.message.startswith(ONLY_SDAR)
    assert "Traceback" not in info.value.message
    assert list(_ask(deployment.address, method="vanilla").token_ids)  # the worker still serves


def test_serve_decode_policy_focus_on_dream_is_refused_at_startup(tiny_dir) -> None:  # noqa: F811
    with pytest.raises(
        ValueError, match=r"--decode-policy focus runs on block-diffusion \(SDAR\) checkpoints only"
    ):
        serve_all(tiny_dir, "--decode-policy", "focus")
