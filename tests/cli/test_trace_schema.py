"""One trace format: `generate --json`, `ask --json` and `eval --traces` print the pdllm.v1 field names, with
every field present (chunk 0's id too), integers as JSON numbers, and the same values for the same request;
the text summaries say that the lowest total score wins."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.app.cli import main as pdllm_main
from pdllm.shared.app.eval import main as eval_main
from pdllm.shared.app.serve import build_parser, start
from pdllm.shared.rpc.trace_format import SCORE_DIRECTION, message_json

from ..model.tiny_checkpoint import make_tiny_checkpoint

CONTEXT = (
    "The archive reopened after a two-year renovation. Letters, maps and oral histories from local residents. "
    "The access code of Mira Halden is 4821. The reading room holds maps from 1912. "
) * 4
QUESTION = "What is the access code of Mira Halden?"
SETTINGS = ["--gen-length", "8", "--steps", "8", "--chunk-size", "16", "--top-k", "2"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def server(tiny_dir):
    args = ["--role", "all", "--model", str(tiny_dir), "--port", "0", "--metrics-port", "-1"]
    deployment = start(build_parser().parse_args(args))
    yield deployment.address
    deployment.stop()


def _shape(value: Any) -> Any:
    """The schema of a JSON value: dict keys (recursively), list element shapes, scalar types."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    return type(value).__name__


def _json(capsys, argv: list[str]) -> tuple[dict, str]:
    assert pdllm_main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def _both(capsys, tiny_dir: Path, address: str, *extra: str) -> tuple[dict, dict]:
    request = ["--context", CONTEXT, "--question", QUESTION, *SETTINGS, *extra, "--json"]
    local, _ = _json(capsys, ["generate", "--model", str(tiny_dir), *request])
    remote, _ = _json(capsys, ["ask", "--server", address, *request])
    return local, remote


def test_generate_and_ask_print_one_schema(tiny_dir, server, capsys) -> None:
    local, remote = _both(capsys, tiny_dir, server, "--method", "pdllm")
    # The proto's fields, every one of them, in both.
    every = set(pb.Trace.DESCRIPTOR.fields_by_name)
    assert set(local["trace"]) == set(remote["trace"]) == every
    assert set(local) == set(remote) == set(pb.GenerateResponse.DESCRIPTOR.fields_by_name)
    assert _shape(local) == _shape(remote)
    lt, rt = local["trace"], remote["trace"]
    # Chunk 0 has its id (proto3 JSON drops zero values unless told), ints are numbers (int64 too).
    assert lt["chunk_scores"][0]["chunk_id"] == rt["chunk_scores"][0]["chunk_id"] == 0
    for trace in (lt, rt):
        assert [c["chunk_id"] for c in trace["chunk_scores"]] == list(range(trace["num_chunks"]))
        assert type(trace["kept_tokens"]) is int and type(trace["peak_memory_bytes"]) is int
        assert type(trace["decode_policy"]["rows_forwarded"]) is int
    # The same request gives the same answer and the same decisions, in process or through the server.
    assert local["text"] == remote["text"] and local["token_ids"] == remote["token_ids"]
    for key in ("method", "kv_mode", "score_mode", "prompt_tokens", "context_tokens", "num_chunks", "steps"):
        assert lt[key] == rt[key], key
    for key in ("selected_chunk_ids", "kept_tokens", "selected_kept_tokens", "cache_misses", "kv_source"):
        assert lt[key] == rt[key], key
    for a, b in zip(lt["chunk_scores"], rt["chunk_scores"], strict=True):
        assert (a["chunk_id"], a["selected"], a["num_tokens"], a["kept_tokens"]) == (
            b["chunk_id"],
            b["selected"],
            b["num_tokens"],
            b["kept_tokens"],
        )
        assert a["total"] == pytest.approx(b["total"], abs=1e-4)
    # The selected chunks are those with the lowest totals.
    ranked = sorted(lt["chunk_scores"], key=lambda c: c["total"])
    assert {c["chunk_id"] for c in ranked[:2]} == set(lt["selected_chunk_ids"])


def test_vanilla_and_policy_counters_share_the_schema(tiny_dir, server, capsys) -> None:
    local, remote = _both(capsys, tiny_dir, server, "--method", "vanilla", "--decode-policy", "dual-cache")
    assert _shape(local) == _shape(remote)
    assert local["text"] == remote["text"]
    assert local["trace"]["decode_policy"] == remote["trace"]["decode_policy"]
    assert local["trace"]["decode_policy"]["refreshes"] >= 1


def test_text_summaries_say_which_score_wins(tiny_dir, server, capsys) -> None:
    request = ["--context", CONTEXT, "--question", QUESTION, *SETTINGS]
    assert pdllm_main(["generate", "--model", str(tiny_dir), *request]) == 0
    local = capsys.readouterr().err
    assert pdllm_main(["ask", "--server", server, *request]) == 0
    remote = capsys.readouterr().err
    for err in (local, remote):
        assert SCORE_DIRECTION in err and "lowest totals: chunk " in err


def test_eval_traces_have_the_schema(tiny_dir, server, tmp_path, capsys) -> None:
    traces = tmp_path / "traces.jsonl"
    argv = ["--model", str(tiny_dir), "--tasks", "needle", "--samples", "2", "--depths", "0.5"]
    argv += ["--length-multiples", "0.25", "--train-length", "256", "--gen-length", "4", "--chunk-size", "16"]
    argv += ["--top-k", "2", "--out", str(tmp_path), "--name", "t", "--traces", str(traces)]
    assert eval_main(argv) == 0
    capsys.readouterr()  # the report
    records = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(records) == 4  # 2 methods x 2 samples
    assert {(r["response"]["trace"]["method"], r["seed"]) for r in records} == {
        (m, s) for m in ("vanilla", "pdllm") for s in (0, 1)
    }
    local, _ = _json(capsys, ["generate", "--model", str(tiny_dir), "--context", CONTEXT, "--question", QUESTION,
                              *SETTINGS, "--json"])  # fmt: skip
    pdllm = next(r for r in records if r["response"]["trace"]["method"] == "pdllm")
    assert _shape(pdllm["response"]) == _shape(local)
    assert set(pdllm) == {"task", "context_length", "depth", "seed", "expected", "exact", "response"}


def test_message_json_keeps_zeros_and_numbers() -> None:
    response = pb.GenerateResponse(text="x")
    response.trace.chunk_scores.add(chunk_id=0, total=1.5)
    response.trace.kept_tokens = 736
    response.trace.decode_policy.counters["rows_total"] = 12
    out = message_json(response)
    assert out["trace"]["chunk_scores"][0]["chunk_id"] == 0
    assert out["trace"]["kept_tokens"] == 736 and out["trace"]["decode_policy"]["counters"] == {
        "rows_total": 12
    }
    assert out["trace"]["timings"]["decode_s"] == 0.0  # an unset message: its fields, like a set one's
    assert list(out) == [f.name for f in pb.GenerateResponse.DESCRIPTOR.fields]
