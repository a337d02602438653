"""`pdllm generate --decode-policy dyllm|focus` (the compute-skipping policies): DyLLM, both methods on a
Dream checkpoint, matches the library; FOCUS runs on SDAR block by block (both methods); FOCUS on Dream and
DyLLM on SDAR are one clear error each, and bad knobs are one clear line (no stack trace)."""

from __future__ import annotations

import json

import pytest

from pdllm.decode_service.server import policy_trace
from pdllm.shared.app.cli import main
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.trace_format import message_json
from tests.reference.vanilla import generate_vanilla

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .test_generate_policy import CONTEXT, QUESTION, _generate

GEN = GenerationConfig(gen_length=8, steps=8, block_length=4)
PDLLM = ["--method", "pdllm", "--chunk-size", "16", "--top-k", "2"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")


def _policy_json(cache: dict) -> dict:
    """The trace's decode_policy for a result's counters, as the decode server reports it."""
    return message_json(policy_trace(cache))


def _library(model_dir, policy: DecodePolicyConfig) -> tuple[str, dict]:
    loaded = load_model(model_dir)
    prompt = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION).vanilla(loaded.config.bos_token_id)
    result = generate_vanilla(loaded.model, prompt, GEN, policy=policy)
    return loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip(), result.cache


@pytest.mark.parametrize(
    ("flags", "policy"),
    [
        (["--decode-policy", "dyllm", "--dyllm-threshold", "0.9"], DecodePolicyConfig("dyllm", dyllm={"dyllm_threshold": 0.9})),
    ],
    ids=["dyllm"],
)  # fmt: skip
def test_vanilla_matches_library(tiny_dir, capsys, flags: list[str], policy: DecodePolicyConfig) -> None:
    assert main(_generate(tiny_dir, "--method", "vanilla", *flags, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    answer, cache = _library(tiny_dir, policy)
    assert out["text"] == answer and out["trace"]["decode_policy"] == _policy_json(cache)
    assert cache["policy"] == policy.name


def test_pdllm_runs_and_names_the_policy(tiny_dir, capsys) -> None:
    assert main([*_generate(tiny_dir, *PDLLM), "--decode-policy", "dyllm", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["trace"]["decode_policy"]
    assert stats["policy"] == "dyllm" and stats["forwards"] == GEN.steps


@pytest.mark.parametrize("method", [["--method", "vanilla"], PDLLM], ids=["vanilla", "pdllm"])
def test_dream_refuses_focus(tiny_dir, capsys, method: list[str]) -> None:
    """FOCUS runs on SDAR only: on a Dream checkpoint it is one clear line, before any forward."""
    assert main([*_generate(tiny_dir, *method), "--decode-policy", "focus"]) == 2
    err = capsys.readouterr().err
    assert (
        "decode policy 'focus' runs on block-diffusion (SDAR) models only; on Dream/LLaDA it measured no "
        "gain over plain decoding" in err
    )
    assert "Traceback" not in err


def test_sdar_vanilla_focus_runs_block_by_block(sdar_dir, capsys) -> None:
    assert main(_generate(sdar_dir, "--method", "vanilla", "--decode-policy", "focus", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    answer, cache = _library(sdar_dir, DecodePolicyConfig("focus"))
    assert out["text"] == answer and out["trace"]["decode_policy"] == _policy_json(cache)
    assert cache["policy"] == "focus"


def test_sdar_pdllm_focus_matches_the_engine(sdar_dir, capsys) -> None:
    assert main([*_generate(sdar_dir, *PDLLM), "--decode-policy", "focus", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    loaded = load_model(sdar_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(chunk_size=16, top_k=2))
    result, _ = engine.generate(ids.context, ids.query, GEN, decode_policy=DecodePolicyConfig("focus"))
    answer = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
    assert out["text"] == answer and out["trace"]["decode_policy"] == _policy_json(result.cache)
    assert result.cache["policy"] == "focus"


def test_sdar_refuses_dyllm(sdar_dir, capsys) -> None:
    assert main(_generate(sdar_dir, "--method", "vanilla", "--decode-policy", "dyllm")) == 2
    err = capsys.readouterr().err
    assert "decode policy 'dyllm' is not supported by block diffusion on SDAR models" in err
    assert "Traceback" not in err
    assert main([*_generate(sdar_dir, *PDLLM), "--decode-policy", "dyllm"]) == 2
    err = capsys.readouterr().err
    assert (
        "decode policy 'dyllm' is not supported by the pdllm engine on SDAR" in err and "Traceback" not in err
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--decode-policy", "dyllm", "--dyllm-threshold", "1.5"], "--dyllm-threshold must be in (0, 1] (got 1.5)"),
        (["--decode-policy", "dyllm", "--dyllm-full-steps", "0"], "--dyllm-full-steps must be in [1, 4096] (got 0)"),
        (["--decode-policy", "focus", "--focus-pool-kernel", "4"], "--focus-pool-kernel must be odd (got 4)"),
        (["--decode-policy", "focus", "--focus-alpha", "0.5"], "--focus-alpha must be in (1, 64] (got 0.5)"),
        (["--decode-policy", "dual-cache", "--focus-budget", "2"], "--focus-budget needs --decode-policy focus, not dual-cache"),
        (["--dyllm-full-sequence-interval", "2"], "--dyllm-full-sequence-interval needs --decode-policy dyllm, not none"),
        (["--decode-policy", "focus", "--cache-refresh-steps", "2"], "--cache-refresh-steps needs a caching --decode-policy (prefix-cache, dual-cache, sparse-dllm or polestar), not focus"),
    ],
)  # fmt: skip
def test_bad_knob_is_one_clear_line(tiny_dir, capsys, extra: list[str], message: str) -> None:
    assert main(_generate(tiny_dir, "--method", "vanilla", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_switch_is_an_argparse_choice_error(tiny_dir, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_generate(tiny_dir, "--decode-policy", "focus", "--focus-delayed-cache", "yes"))
    assert exc.value.code == 2
    assert "--focus-delayed-cache: invalid choice: 'yes'" in capsys.readouterr().err
