"""One test per setting and bound, derived from the schema (`shared/settings.py`): a value just outside each
bound (or a choice that does not exist) is refused everywhere the setting enters, each time naming it as
that caller spells it: a public request (INVALID_ARGUMENT naming `generation.x` / `method.x` /
`decode_policy.x`, in process and over gRPC), the engine's own configs (`x` / its EngineConfig name),
`pdllm generate`'s flag (`--x`) and its environment variable (`PDLLM_X`). The bounds themselves are pinned below, so that dropping one from the
schema fails a test rather than silently dropping its derived cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pdllm.shared import settings, settings_flags
from pdllm.shared.app.cli import main
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import InvalidRequestError
from pdllm.shared.rpc.server import RpcServer, ServerConfig, build_server
from pdllm.shared.rpc.validation import ValidationLimits, resolve_generate_request
from pdllm.shared.settings import (
    DecodePolicySettings,
    EngineOnlySettings,
    GenerationSettings,
    MethodSettings,
    Settings,
)
from tests.model.tiny_checkpoint import make_tiny_checkpoint
from tests.rpc.cases import valid_request
from tests.rpc.fake_generation import MODEL, FakeGeneration, fake_spec

LIMITS = ValidationLimits(models=(MODEL,), max_prompt_bytes=65536)
GROUPS: dict[str, type[Settings]] = {
    "generation": GenerationSettings,
    "method": MethodSettings,
    "decode_policy": DecodePolicySettings,
}
_BASE = resolve_generate_request(valid_request(), LIMITS)
REQUEST_BASE = {
    **dict(_BASE.generation_settings()),
    **dict(_BASE.method_settings()),
    **dict(_BASE.decode_policy_settings()),
}


def outside(cls: type[Settings], name: str, values: dict[str, Any], request: bool) -> list[Any]:
    """A value just below / above each of the setting's bounds given ``values``, or a choice that is none."""
    if options := settings.choices(cls, name):
        return ["no-such-" + options[0]]
    lo, lo_open, hi, _ = settings.bounds(cls, name, values, request)
    integer = settings.value_type(cls, name) is int
    cases = []
    if lo is not None:
        cases.append(lo if lo_open else lo - 1 if integer or lo <= 0 else lo / 2)
    if hi is not None:
        cases.append(hi + 1)
    return [v if integer else float(v) for v in cases]


def _cases(groups: dict[str, type[Settings]], base: dict[str, Any], request: bool) -> list[Any]:
    return [
        pytest.param(group, name, value, id=f"{name}={value!r}")
        for group, cls in groups.items()
        for name in cls.model_fields
        for value in outside(cls, name, {**cls().model_dump(), **base}, request)
    ]


REQUEST_CASES = _cases(GROUPS, REQUEST_BASE, request=True)
# `generate` takes the engine-only settings too; its baseline is the schema's defaults (the tiny checkpoint
# below has no pdllm.json).
CLI_GROUPS = {**GROUPS, "engine": EngineOnlySettings}
CLI_CASES = _cases(CLI_GROUPS, {}, request=False)

# What a public request may ask, as clients read it in the error message.
PUBLIC = {
    "generation.gen_length": "in [1, 4096]",
    "generation.steps": "in [1, 32], at most generation.gen_length",
    "generation.block_length": "> 0",
    "generation.threshold": "in (0, 1]",
    "generation.temperature": "0 (greedy) or in [0.0001, 10000]",
    "generation.seed": ">= 0",
    "method.method": "one of vanilla, pdllm",
    "method.chunk_size": "in [16, 16384]",
    "method.top_k": "in [1, 1024]",
    "method.top_b": "in [1, 65], at most method.chunk_size + 1",
    "method.kv_mode": "one of full-mask, chunk-query, chunk-only",
    "method.score_mode": "one of pseudo-label, self-info, query-only",
    "method.pseudo_label_tokens": "in [1, 64]",
    "method.pseudo_label_rounds": "in [1, 4], at most method.pseudo_label_tokens",
    "method.retention_score": "one of bidirectional, query-to-chunk",
    "method.query_window": "in [1, 4096]",
    "method.prefill_attention": "one of causal, bidirectional",
    "decode_policy.decode_policy": "one of none, prefix-cache, dual-cache, sparse-dllm, polestar, dyllm, focus",
    "decode_policy.cache_refresh_steps": "in [1, 4096]",
    "decode_policy.sparse_retention": "in (0, 1]",
    "decode_policy.sparse_pool_kernel": "in [1, 255]",
    "decode_policy.sparse_delay_steps": "in [0, 4096]",
    "decode_policy.polestar_clusters": "in [1, 1024]",
    "decode_policy.polestar_top_clusters": "in [1, 1024]",
    "decode_policy.polestar_update_threshold": "in [0, 4096]",
    "decode_policy.polestar_drift_threshold": "in [0, 1e+06]",
    "decode_policy.polestar_residual_format": "one of int8, fp8, none",
    "decode_policy.polestar_recompute": "one of propagated, per-layer",
    "decode_policy.dyllm_threshold": "in (0, 1]",
    "decode_policy.dyllm_full_steps": "in [1, 4096]",
    "decode_policy.dyllm_full_sequence_interval": "in [1, 4096]",
    "decode_policy.dyllm_approximate_attention": "one of on, off",
    "decode_policy.focus_alpha": "in (1, 64]",
    "decode_policy.focus_pool_kernel": "in [1, 255]",
    "decode_policy.focus_budget": "in [1, 4096]",
    "decode_policy.focus_delayed_cache": "one of on, off",
}


def test_every_setting_has_cases() -> None:
    for cases, groups in ((REQUEST_CASES, GROUPS), (CLI_CASES, CLI_GROUPS)):
        assert {c.values[1] for c in cases} == {n for cls in groups.values() for n in cls.model_fields}


def _request(group: str, name: str, value: Any):
    req = valid_request()
    setattr(getattr(req, group), name, value)
    return req


def test_public_bounds_are_pinned() -> None:
    accepted = {}
    for group, name, value in (c.values for c in REQUEST_CASES):
        with pytest.raises(InvalidRequestError) as info:
            resolve_generate_request(_request(group, name, value), LIMITS)
        accepted[f"{group}.{name}"] = info.value.message.split(" must be ", 1)[1].rsplit(" (got ", 1)[0]
    assert accepted == PUBLIC


def test_engine_bounds_are_pinned() -> None:
    assert [c.id for c in CLI_CASES] == [
        "gen_length=0", "steps=0", "block_length=0", "threshold=0.0", "threshold=2.0", "temperature=5e-05",
        "temperature=10001.0", "seed=-1", "method='no-such-vanilla'", "chunk_size=0", "top_k=0", "top_b=0",
        "kv_mode='no-such-full-mask'", "score_mode='no-such-pseudo-label'", "pseudo_label_tokens=0",
        "pseudo_label_rounds=0", "pseudo_label_rounds=5", "retention_score='no-such-bidirectional'",
        "query_window=0", "prefill_attention='no-such-causal'", "decode_policy='no-such-none'",
        "cache_refresh_steps=0", "cache_refresh_steps=4097", "sparse_retention=0.0", "sparse_retention=2.0",
        "sparse_pool_kernel=0", "sparse_pool_kernel=256", "sparse_delay_steps=-1", "sparse_delay_steps=4097",
        "polestar_clusters=0", "polestar_clusters=1025", "polestar_top_clusters=0", "polestar_top_clusters=1025",
        "polestar_update_threshold=-1", "polestar_update_threshold=4097", "polestar_drift_threshold=-1.0",
        "polestar_drift_threshold=1000001.0", "polestar_residual_format='no-such-int8'",
        "polestar_recompute='no-such-propagated'",
        "dyllm_threshold=0.0", "dyllm_threshold=2.0", "dyllm_full_steps=0", "dyllm_full_steps=4097",
        "dyllm_full_sequence_interval=0", "dyllm_full_sequence_interval=4097",
        "dyllm_approximate_attention='no-such-on'", "focus_alpha=1.0", "focus_alpha=65.0", "focus_pool_kernel=0",
        "focus_pool_kernel=256", "focus_budget=0", "focus_budget=4097", "focus_delayed_cache='no-such-on'",
        "chunk_boundary='no-such-fixed'", "prefill_batch=0", "retention_block=0",
    ]  # fmt: skip


@pytest.mark.parametrize(("group", "name", "value"), REQUEST_CASES)
def test_request_validation_refuses_it(group: str, name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve_generate_request(_request(group, name, value), LIMITS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(f"{group}.{name} must be "), info.value.message
    assert info.value.kind.startswith((name, f"unknown_{name}")), info.value.kind


@pytest.fixture(scope="module")
def server() -> Iterator[RpcServer]:
    servicer = FakeGeneration(limits=LIMITS, step_delay_s=0.0)
    server = build_server(ServerConfig(role="test", metrics_port=None), [fake_spec(servicer)]).start()
    yield server
    server.stop()


@pytest.mark.parametrize(("group", "name", "value"), REQUEST_CASES)
def test_grpc_answers_invalid_argument(server: RpcServer, group: str, name: str, value: Any) -> None:
    with PdllmClient(server.address) as client, pytest.raises(InvalidRequestError) as info:
        client.generate_request(_request(group, name, value), timeout_s=5)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{group}.{name} must be " in info.value.message, info.value.message


@pytest.mark.parametrize(("group", "name", "value"), CLI_CASES)
def test_engine_configs_refuse_it(group: str, name: str, value: Any) -> None:
    if group == "decode_policy":  # DecodePolicyConfig names its fields otherwise; its errors use the schema's
        with pytest.raises(ValueError, match=f"^{name} must be "):
            settings.decode_policy_config({name: value})
        return
    engine = name if group == "generation" else settings.engine_name(settings.EngineSettings, name)
    with pytest.raises(ValueError, match=f"^{engine or name} must be "):
        if group == "generation":
            GenerationConfig(**{name: value}).validate()
        elif engine:
            EngineConfig(**{engine: value})
        else:  # `method` is no EngineConfig field
            settings.engine_config({name: value})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def _generate(tiny_dir, capsys, *extra: str) -> tuple[int, str]:
    argv = [
        "generate",
        "--model",
        str(tiny_dir),
        "--context",
        "The code is 4821. " * 4,
        "--question",
        "Code?",
    ]
    try:
        code = main([*argv, *extra])
    except SystemExit as exit:  # argparse refuses an unknown choice itself
        code = exit.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("group", "name", "value"), CLI_CASES)
def test_generate_flag_refuses_it(tiny_dir, capsys, group: str, name: str, value: Any) -> None:
    code, err = _generate(tiny_dir, capsys, settings_flags.flag(name), str(value))
    assert code == 2 and "Traceback" not in err
    # argparse's own choice error follows its usage
    assert settings_flags.flag(name) in err.splitlines()[-1], err


@pytest.mark.parametrize(("group", "name", "value"), CLI_CASES)
def test_generate_env_variable_refuses_it(
    tiny_dir, capsys, monkeypatch, group: str, name: str, value
) -> None:
    variable = settings_flags.env_name(settings_flags.flag(name))
    monkeypatch.setenv(variable, str(value))
    code, err = _generate(tiny_dir, capsys)
    assert code == 2 and "Traceback" not in err
    assert (
        err.startswith(f"error: {settings_flags.flag(name)} (${variable}) must be ") and err.count("\n") == 1
    ), err


def test_env_variable_is_the_flags_default_and_the_flag_wins(tiny_dir, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PDLLM_GEN_LENGTH", "4")
    monkeypatch.setenv("PDLLM_METHOD", "vanilla")
    assert _generate(tiny_dir, capsys, "--json", "--steps", "2")[0] == 0
    code, err = _generate(tiny_dir, capsys, "--gen-length", "0")
    assert (code, err) == (2, "error: --gen-length ($PDLLM_GEN_LENGTH) must be > 0 (got 0)\n")
    monkeypatch.setenv("PDLLM_TOP_K", "two")
    assert _generate(tiny_dir, capsys) == (2, "error: $PDLLM_TOP_K='two' is not a valid value for --top-k\n")
