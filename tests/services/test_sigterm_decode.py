"""SIGTERM while `serve --role all` runs a long vanilla decode step: the process drains and exits 0.

A SIGTERM during a long vanilla decode once aborted the process ("terminate called without an
active exception", exit -6): the drain stopped the servers, the decode scheduler's thread was given 5 s to
end, and the interpreter exited while that daemon thread was still inside a multi-second torch forward.
A vanilla step cannot be cut short, so the process must wait for it and only then exit.

The shipped model (32K positions) makes one vanilla step over ~12K tokens last several seconds on a CPU
(8-16 s on the 2-core CI host); the abort needs a step that outlasts the old 5 s join, so a much faster
machine passes the first test even without the fix.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import PdllmError
from tests.services.cluster import ServeProcess

pytestmark = pytest.mark.slow

SENTENCE = "The archive reopened after a long renovation and the maps date from 1912. "  # ~24 tokens
QUESTION = "What year are the maps from?"


def _stream(address: str, context: str, out: list) -> None:
    """Consume one vanilla stream; ``out`` gets its messages, then the error that ended it (if any)."""
    with PdllmClient(address) as client:
        try:
            for event in client.generate_stream(
                context, QUESTION, method="vanilla", gen_length=2, steps=2, timeout_s=300
            ):
                out.append(event)
        except PdllmError as err:
            out.append(err)


def _sigterm_mid_decode(proc: ServeProcess, context: str) -> tuple[list, threading.Thread]:
    """Start a vanilla stream, wait until the decode scheduler holds it (a step runs from then on until it
    finishes), and send SIGTERM. Returns what the client received so far and its thread."""
    received: list = []
    client = threading.Thread(target=_stream, args=(proc.address, context, received), daemon=True)
    client.start()
    deadline = time.monotonic() + 60
    while proc.metric("pdllm_decode_active") < 1:
        assert time.monotonic() < deadline, "the vanilla request never reached the decode scheduler"
        assert client.is_alive(), f"the stream ended before decoding: {received}"
        time.sleep(0.05)
    finished = any(not isinstance(e, PdllmError) and e.HasField("final") for e in received)
    assert not finished, "the request ended before SIGTERM: make the context longer"
    proc.proc.send_signal(signal.SIGTERM)
    return received, client


def _exit_code(proc: ServeProcess, timeout_s: float) -> int:
    rc = proc.proc.wait(timeout=timeout_s)
    time.sleep(0.2)  # the stderr pump reads the last lines
    log = "\n".join(proc.log)
    assert "terminate called" not in log and "Traceback" not in log, log[-3000:]
    return rc


def test_sigterm_during_a_long_vanilla_step_exits_cleanly() -> None:
    """No drain grace: the stream ends at once with a clean status, and the process waits for the step in
    progress instead of exiting under it (before the fix: exit -6 with 'terminate called')."""
    proc = ServeProcess("all", ["--port", "0", "--metrics-port", "0", "--drain-seconds", "0"]).start()
    try:
        received, client = _sigterm_mid_decode(proc, SENTENCE * 500)
        signalled = time.monotonic()
        client.join(timeout=10)
        assert not client.is_alive(), "the client still waits after the drain ended its call"
        assert time.monotonic() - signalled < 10
        assert received and isinstance(received[-1], PdllmError), received
        assert received[-1].code.name in ("CANCELLED", "UNAVAILABLE"), received[-1]
        assert _exit_code(proc, timeout_s=240) == 0
    finally:
        proc.kill()


def test_sigterm_drains_a_vanilla_request_to_its_answer() -> None:
    """With the default grace the request in flight finishes and the client gets its final answer."""
    proc = ServeProcess("all", ["--port", "0", "--metrics-port", "0"]).start()
    try:
        received, client = _sigterm_mid_decode(proc, SENTENCE * 120)
        client.join(timeout=120)
        assert not client.is_alive()
        kinds = [e.WhichOneof("event") if not isinstance(e, PdllmError) else repr(e) for e in received]
        assert kinds == ["partial", "partial", "final"], kinds
        assert _exit_code(proc, timeout_s=60) == 0
        assert any('"all_finished": true' in line for line in proc.log)
    finally:
        proc.kill()
