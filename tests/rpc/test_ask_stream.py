"""`pdllm ask --stream`: one line redrawn in place on a terminal, a plain line per step when piped."""

from __future__ import annotations

import io
import sys

import pytest

from pdllm.shared.rpc.ask import main
from tests.rpc.conftest import StartServer
from tests.rpc.fake_generation import MODEL


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _argv(address: str) -> list[str]:
    return ["--server", address, "--context", "The code is 4711. " * 20, "--question", "code?", "--model", MODEL,
            "--gen-length", "4", "--steps", "4", "--stream", "--json"]  # fmt: skip


def test_piped_stream_prints_a_line_per_step(start_server: StartServer, capsys) -> None:
    server, _ = start_server(step_delay_s=0.0)
    assert main(_argv(server.address)) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    assert err.splitlines() == [line for line in err.splitlines() if line.startswith("[step ")]
    assert [line.split("]")[0] for line in err.splitlines()] == [f"[step {i}/4" for i in range(1, 5)]


def test_terminal_stream_redraws_one_line(start_server: StartServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = start_server(step_delay_s=0.0)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(_argv(server.address)) == 0
    err = terminal.getvalue()
    assert err.count("\r\x1b[K[step ") == 4  # each step erases the line and redraws it
    assert err.count("\n") == 1 and err.endswith("\n")  # one line in the end
    assert err.rstrip("\n").rsplit("\r\x1b[K", 1)[-1].startswith("[step 4/4]")
