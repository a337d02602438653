"""Request validation: every bad-input kind is detected with its message; defaults resolve as documented."""

from __future__ import annotations

import pytest

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.rpc.client import build_generate_request
from pdllm.shared.rpc.errors import InvalidRequestError
from pdllm.shared.rpc.validation import (
    DecodePolicySettings,
    GenerationSettings,
    MethodSettings,
    RequestDefaults,
    ValidationLimits,
    resolve_generate_request,
)
from tests.rpc.cases import BAD_INPUTS, valid_request
from tests.rpc.fake_generation import MODEL

LIMITS = ValidationLimits(models=(MODEL,), max_prompt_bytes=65536)


def test_valid_request_resolves_exactly() -> None:
    resolved = resolve_generate_request(valid_request(), LIMITS)
    assert resolved.generation_settings() == GenerationSettings(
        gen_length=32, steps=16, block_length=8, threshold=None, temperature=0.0, seed=0
    )
    assert resolved.method_settings() == MethodSettings(
        method="pdllm",
        chunk_size=64,
        top_k=2,
        top_b=None,
        kv_mode="full-mask",
        score_mode="pseudo-label",
        pseudo_label_tokens=4,
        pseudo_label_rounds=2,
        retention_score="bidirectional",
        query_window=None,
        prefill_attention="causal",
    )
    assert resolved.decode_policy_settings() == DecodePolicySettings(decode_policy="none")
    assert resolved.instruction is None and resolved.model == MODEL and resolved.request_id == "req-1"


def test_decode_policy_takes_the_servers_only_when_the_request_names_none() -> None:
    defaults = RequestDefaults(decode_policy="sparse-dllm", sparse_retention=0.25, cache_refresh_steps=4)
    req = valid_request()
    # Names none: the server's policy and knobs, its own knobs over them.
    req.decode_policy.sparse_pool_kernel = 5
    p = resolve_generate_request(req, LIMITS, defaults).decode_policy_settings()
    assert p == DecodePolicySettings(
        decode_policy="sparse-dllm", sparse_retention=0.25, cache_refresh_steps=4, sparse_pool_kernel=5
    )
    # Names one: none of the server's knobs (sparse ones would not even fit dual cache).
    req = valid_request()
    req.decode_policy.decode_policy = "dual-cache"
    p = resolve_generate_request(req, LIMITS, defaults).decode_policy_settings()
    assert p == DecodePolicySettings(decode_policy="dual-cache")
    assert resolve_generate_request(req, LIMITS, defaults).decode_policy == "dual-cache"  # reads flat too


def test_unset_fields_take_defaults_and_zero_is_kept_where_meaningful() -> None:
    req = pb.GenerateRequest(context="c", question="q", instruction="")
    req.generation.temperature = 0.0
    req.generation.seed = 0
    defaults = RequestDefaults(gen_length=24, block_length=16, steps=12, temperature=0.7, seed=9, model="m")
    resolved = resolve_generate_request(req, ValidationLimits(), defaults)
    gen = resolved.generation_settings()
    # 16 does not divide 24, so the default block falls back to one block; steps 12 then fits.
    assert (gen.gen_length, gen.block_length, gen.steps) == (24, 24, 12)
    assert (gen.temperature, gen.seed) == (0.0, 0)  # explicitly set zeros are not defaults
    assert resolved.instruction == "" and resolved.model == "m"


def test_threshold_makes_steps_a_cap_not_an_even_split() -> None:
    req = valid_request()
    req.generation.steps = 6  # 4 blocks: rejected for the fixed schedule ...
    with pytest.raises(InvalidRequestError):
        resolve_generate_request(req, LIMITS)
    req.generation.threshold = 0.9  # ... but fine as the cap of a confidence-threshold schedule
    assert resolve_generate_request(req, LIMITS).steps == 6


def test_pseudo_label_bounds_only_apply_to_pseudo_label_scoring() -> None:
    req = valid_request()
    req.method.score_mode = "self-info"
    req.method.pseudo_label_tokens = 0
    assert resolve_generate_request(req, LIMITS).score_mode == "self-info"


@pytest.mark.parametrize(
    ("kind", "edit", "phrase"), BAD_INPUTS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_rejected_with_its_kind(kind: str, edit, phrase: str) -> None:
    req = valid_request()
    resolve_generate_request(req, LIMITS)  # the baseline is valid, so the edit alone causes the error
    edit(req)
    with pytest.raises(InvalidRequestError) as info:
        resolve_generate_request(req, LIMITS)
    assert info.value.kind == kind
    assert phrase in info.value.message
    assert info.value.code.name == "INVALID_ARGUMENT"


def test_at_least_twenty_distinct_kinds() -> None:
    assert len({kind for kind, _, _ in BAD_INPUTS}) >= 28


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"context": "bad \ud800 surrogate"}, "invalid_unicode"),
        ({"question": "\udfff"}, "invalid_unicode"),
        ({"instruction": "nul\x00"}, "nul_character"),
        ({"context": b"bytes are not text"}, "not_text"),
    ],
)
def test_client_rejects_unsendable_text_locally(kwargs: dict, kind: str) -> None:
    args = {"context": "c", "question": "q"} | kwargs
    with pytest.raises(InvalidRequestError) as info:
        build_generate_request(args.pop("context"), args.pop("question"), **args)
    assert info.value.kind == kind


def test_build_generate_request_sets_only_given_optionals() -> None:
    req = build_generate_request("c", "q", gen_length=16, temperature=0.0, top_b=8, kv_mode="chunk-only")
    assert req.generation.HasField("gen_length") and req.generation.HasField("temperature")
    assert not req.generation.HasField("steps") and not req.generation.HasField("seed")
    assert req.method.top_b == 8 and not req.method.HasField("top_k")
    assert req.method.kv_mode == "chunk-only" and not req.HasField("instruction")
