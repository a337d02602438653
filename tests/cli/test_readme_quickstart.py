"""The README's quickstart, run as written: its commands and expected output are read from the README (the
blocks after the `<!-- quickstart: ... -->` markers), so an edit that breaks them fails here.

The server command runs in the background until it prints its "serving on" line; the client commands run
one after the other against it. Only the ports are the test's own (free ones, through the PDLLM_PORT /
PDLLM_METRICS_PORT / PDLLM_SERVER variables the commands read), so a server already on 50051 does not
interfere."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def blocks(text: str) -> dict[str, str]:
    """The fenced block after each `<!-- quickstart: NAME -->` marker, by NAME."""
    found = re.findall(r"<!-- quickstart: (\w+) -->\s*```\w*\n(.*?)```", text, re.S)
    return dict(found)


def commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, blank lines and comments left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_names_the_quickstart_blocks() -> None:
    found = blocks(README.read_text())
    assert set(found) == {"server", "client", "output"}
    assert commands(found["server"])[0].startswith("pdllm serve")
    client = commands(found["client"])
    assert [c.split()[:2] for c in client] == [["pdllm", "ask"], ["pdllm", "generate"]]
    assert all("shared/data/demo_document.txt" in c for c in client)  # the bundled document, by its path
    assert (ROOT / "shared/data/demo_document.txt").is_file()


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path) -> None:
    found = blocks(README.read_text())
    (server_command,) = commands(found["server"])
    expected = found["output"].splitlines()
    answer = expected[0]
    facts = [
        m.group(0) for m in re.finditer(r"prompt tokens \d+|chunks \d+|selected \[[\d, ]+\]", found["output"])
    ]
    assert len(facts) == 3, facts
    port = _free_port()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this Python's `pdllm`
    env |= {"PDLLM_PORT": str(port), "PDLLM_METRICS_PORT": str(_free_port())}
    env["PDLLM_SERVER"] = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {server_command}"],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_until_serving(server, log, timeout_s=180)
        for command in commands(found["client"]):
            started = time.perf_counter()
            res = subprocess.run(
                ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
            )
            assert res.returncode == 0, f"{command}\n{res.stderr[-3000:]}"
            assert res.stdout.splitlines()[0] == answer, (command, res.stdout)
            for fact in facts:
                assert fact in res.stderr, (command, fact, res.stderr[-2000:])
            print(f"{command.split()[1]}: {time.perf_counter() - started:.1f} s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_until_serving(server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Wait for the server's "serving on" line (the README tells the reader to wait for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        if " serving on " in log.read_text():
            return
        time.sleep(0.2)
    pytest.fail("the README's server command did not start:\n" + log.read_text()[-3000:])
