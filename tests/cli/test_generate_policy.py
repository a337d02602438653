"""`pdllm generate --decode-policy`: selectable from the command line for both methods, bad values refused."""

from __future__ import annotations

import json

import pytest

from pdllm.decode_service.server import policy_trace
from pdllm.shared.app.cli import main
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.trace_format import message_json
from tests.reference.vanilla import generate_vanilla

from ..model.tiny_checkpoint import make_tiny_checkpoint

CONTEXT = "The archive reopened after a two-year renovation. The access code of Mira Halden is 4821. " * 3
QUESTION = "What is the access code of Mira Halden?"
GEN = ["--gen-length", "8", "--steps", "8", "--block-length", "4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def _generate(tiny_dir, *extra: str) -> list[str]:
    return ["generate", "--model", str(tiny_dir), "--context", CONTEXT, "--question", QUESTION, *GEN, *extra]


def test_vanilla_dual_cache_matches_library(tiny_dir, capsys) -> None:
    assert main(_generate(tiny_dir, "--method", "vanilla", "--decode-policy", "dual-cache", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    expected = generate_vanilla(
        loaded.model, ids.vanilla(loaded.config.bos_token_id), gen, policy=DecodePolicyConfig("dual-cache")
    )
    assert out["text"] == loaded.tokenizer.decode(expected.token_ids, skip_special_tokens=True).strip()
    policy = out["trace"]["decode_policy"]
    assert policy == message_json(policy_trace(expected.cache)) and policy["refreshes"] >= 1


def test_pdllm_prefix_cache_runs_and_names_the_policy(tiny_dir, capsys) -> None:
    args = _generate(tiny_dir, "--method", "pdllm", "--chunk-size", "16", "--top-k", "2")
    assert main([*args, "--decode-policy", "prefix-cache", "--cache-refresh-steps", "2"]) == 0
    err = capsys.readouterr().err
    assert "decode policy prefix-cache" in err


def test_no_policy_reports_none(tiny_dir, capsys) -> None:
    assert main(_generate(tiny_dir, "--method", "vanilla", "--json")) == 0
    policy = json.loads(capsys.readouterr().out)["trace"]["decode_policy"]
    assert policy["policy"] == "none" and policy["forwards"] == 0 and policy["counters"] == {}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cache-refresh-steps", "0", "--decode-policy", "dual-cache"], "--cache-refresh-steps must be in [1, 4096] (got 0)"),
        (["--cache-refresh-steps", "5000", "--decode-policy", "dual-cache"], "--cache-refresh-steps must be in [1, 4096] (got 5000)"),
        (["--decode-policy", "polestar", "--polestar-clusters", "0"], "--polestar-clusters must be in [1, 1024] (got 0)"),
        (["--decode-policy", "polestar", "--polestar-clusters", "2", "--polestar-top-clusters", "3"], "--polestar-top-clusters must be in [1, 2], at most --polestar-clusters (got 3)"),
        (["--polestar-update-threshold", "2"], "--polestar-update-threshold needs --decode-policy polestar, not none"),
        (["--cache-refresh-steps", "2"], "--cache-refresh-steps needs a caching --decode-policy (prefix-cache, dual-cache, sparse-dllm or polestar), not none"),
    ],
)  # fmt: skip
def test_bad_knob_is_one_clear_line(tiny_dir, capsys, extra: list[str], message: str) -> None:
    assert main(_generate(tiny_dir, "--method", "vanilla", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_policy_is_refused(tiny_dir, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_generate(tiny_dir, "--decode-policy", "lru-cache"))
    assert exc.value.code == 2
    assert "--decode-policy: invalid choice: 'lru-cache'" in capsys.readouterr().err


def test_unknown_policy_from_the_environment_names_the_variable(tiny_dir, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PDLLM_DECODE_POLICY", "lru-cache")
    assert main(_generate(tiny_dir, "--method", "vanilla")) == 2
    err = capsys.readouterr().err
    assert "--decode-policy ($PDLLM_DECODE_POLICY) must be one of none, prefix-cache, dual-cache" in err


def test_vanilla_sparse_dllm_matches_library(tiny_dir, capsys) -> None:
    knobs = ["--sparse-retention", "0.25", "--sparse-pool-kernel", "1", "--sparse-delay-steps", "2"]
    args = _generate(tiny_dir, "--method", "vanilla", "--decode-policy", "sparse-dllm", *knobs, "--json")
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    policy = DecodePolicyConfig("sparse-dllm", retention=0.25, pool_kernel=1, delay_steps=2)
    expected = generate_vanilla(loaded.model, ids.vanilla(loaded.config.bos_token_id), gen, policy=policy)
    assert out["text"] == loaded.tokenizer.decode(expected.token_ids, skip_special_tokens=True).strip()
    policy = out["trace"]["decode_policy"]
    assert policy == message_json(policy_trace(expected.cache)) and policy["policy"] == "sparse-dllm"


def test_pdllm_sparse_dllm_runs_with_the_papers_defaults(tiny_dir, capsys) -> None:
    args = _generate(tiny_dir, "--method", "pdllm", "--chunk-size", "16", "--top-k", "2")
    assert main([*args, "--decode-policy", "sparse-dllm", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["trace"]["decode_policy"]
    assert stats["policy"] == "sparse-dllm" and stats["refreshes"] == 2  # one cache per block


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--decode-policy", "sparse-dllm", "--sparse-retention", "0"], "--sparse-retention must be in (0, 1] (got 0.0)"),
        (["--decode-policy", "sparse-dllm", "--sparse-retention", "1.01"], "--sparse-retention must be in (0, 1] (got 1.01)"),
        (["--decode-policy", "sparse-dllm", "--sparse-pool-kernel", "2"], "--sparse-pool-kernel must be odd (got 2)"),
        (["--decode-policy", "sparse-dllm", "--sparse-delay-steps", "-1"], "--sparse-delay-steps must be in [0, 4096] (got -1)"),
        (["--decode-policy", "dual-cache", "--sparse-retention", "0.5"], "--sparse-retention needs --decode-policy sparse-dllm, not dual-cache"),
    ],
)  # fmt: skip
def test_bad_sparse_knob_is_one_clear_line(tiny_dir, capsys, extra: list[str], message: str) -> None:
    assert main(_generate(tiny_dir, "--method", "vanilla", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
