"""`pdllm ask` against a real server: answer on stdout, trace on stderr, clear errors and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdllm.shared.app.cli import main as pdllm_main
from pdllm.shared.rpc.ask import main
from tests.rpc.conftest import StartServer
from tests.rpc.fake_generation import MODEL


def test_ask_prints_answer_and_trace(start_server: StartServer, tmp_path: Path, capsys) -> None:
    server, _ = start_server(step_delay_s=0.0)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The access code of Mira Halden is 4711.\n" * 50, encoding="utf-8")
    argv = ["--server", server.address, "--context-file", str(ctx), "--question", "code?", "--model", MODEL]
    assert main([*argv, "--gen-length", "8", "--steps", "4", "--chunk-size", "256", "--top-k", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == "code?\n"
    assert "selected [0, 1, 2]" in err and "steps 4" in err
    # Through the top-level CLI, streaming, JSON output.
    assert pdllm_main(["ask", *argv, "--gen-length", "4", "--steps", "2", "--stream", "--json"]) == 0
    out, err = capsys.readouterr()
    final = json.loads(out)
    assert final["text"] == "code" and final["trace"]["steps"] == 2
    assert err.count("[step ") == 2


def test_ask_errors_are_one_line_with_exit_codes(start_server: StartServer, tmp_path: Path, capsys) -> None:
    server, _ = start_server(auth_token="tok")
    base = ["--server", server.address, "--context", "ctx", "--question", "q?", "--model", MODEL]
    assert main(base) == 1
    assert capsys.readouterr().err.startswith("error: UNAUTHENTICATED: missing bearer token")
    token = tmp_path / "token"
    token.write_text("tok\n")
    assert main([*base, "--token-file", str(token), "--gen-length", "10", "--block-length", "4"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("error: INVALID_ARGUMENT: generation.gen_length (10) must be divisible")
        and err.count("\n") == 1
    )
    # Decode-policy flags come from the schema too, and reach the server's validation.
    policy = ["--decode-policy", "dual-cache", "--sparse-retention", "0.5"]
    assert main([*base, "--token-file", str(token), *policy]) == 1
    assert capsys.readouterr().err == (
        "error: INVALID_ARGUMENT: decode_policy.sparse_retention needs decode_policy.decode_policy "
        "sparse-dllm, not dual-cache\n"
    )
    assert main([*base, "--token-file", str(tmp_path / "missing")]) == 2
    assert "cannot read token" in capsys.readouterr().err
    assert main(["--server", server.address, "--context", "bad \ud800", "--question", "q"]) == 2
    assert "not valid Unicode" in capsys.readouterr().err


def test_ask_unreachable_server_fails_fast(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDLLM_AUTH_TOKEN", "tok")
    assert main(["--server", "127.0.0.1:1", "--context", "c", "--question", "q", "--timeout", "2"]) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")
