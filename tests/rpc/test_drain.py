"""Graceful drain: health flips to NOT_SERVING, new calls get UNAVAILABLE, running calls finish (or are
cancelled when the grace period ends); and the same on SIGTERM in a separate server process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import PdllmError
from tests.rpc.conftest import StartServer
from tests.rpc.fake_generation import MODEL

REPO_ROOT = Path(__file__).resolve().parents[2]


def _consume(client: PdllmClient, out: list, steps: int) -> None:
    try:
        out.extend(
            client.generate_stream("ctx", "slow", model=MODEL, gen_length=steps, steps=steps, timeout_s=20)
        )
    except PdllmError as err:
        out.append(err)


def _check_draining_behaviour(client: PdllmClient) -> None:
    assert client.health() == "NOT_SERVING"
    assert client.health("pdllm.v1.Generation") == "NOT_SERVING"
    with pytest.raises(PdllmError) as info:
        client.generate("ctx", "q?", model=MODEL, timeout_s=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "draining" in info.value.message


def test_drain_lets_running_stream_finish(start_server: StartServer) -> None:
    server, servicer = start_server(step_delay_s=0.05)
    with PdllmClient(server.address) as client:
        received: list = []
        consumer = threading.Thread(target=_consume, args=(client, received, 20))
        consumer.start()
        assert servicer.started.wait(5)
        result: list[bool] = []
        drainer = threading.Thread(target=lambda: result.append(server.drain(grace_s=10)))
        drainer.start()
        while not server.admission.draining:
            time.sleep(0.005)
        _check_draining_behaviour(client)
        consumer.join(10)
        drainer.join(10)
    assert result == [True]
    assert [m.WhichOneof("event") for m in received] == ["partial"] * 20 + ["final"]
    assert servicer.completed_streams == 1
    assert server.registry.get_sample_value("pdllm_draining", {"role": "test"}) == 1


def test_drain_cancels_calls_that_outlive_the_grace(start_server: StartServer) -> None:
    server, servicer = start_server(step_delay_s=0.05)
    with PdllmClient(server.address) as client:
        received: list = []
        consumer = threading.Thread(target=_consume, args=(client, received, 200))
        consumer.start()
        assert servicer.started.wait(5)
        started = time.monotonic()
        assert server.drain(grace_s=0.3) is False
        assert time.monotonic() - started < 3
        consumer.join(10)
    assert isinstance(received[-1], PdllmError)
    assert received[-1].code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert servicer.completed_streams == 0 and servicer.cancelled.wait(5)


def test_sigterm_drains_a_server_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.rpc.drain_server", "--grace", "10", "--step-delay", "0.05"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ports = json.loads(proc.stdout.readline())
        with PdllmClient(f"127.0.0.1:{ports['port']}") as client:
            assert client.health() == "SERVING"
            stream = client.generate_stream("ctx", "slow", model=MODEL, gen_length=30, steps=30, timeout_s=20)
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while client.health() == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.01)
            _check_draining_behaviour(client)
            rest = list(stream)
        messages: list[pb.GenerateStreamResponse] = [first, *rest]
        assert [m.partial.step for m in messages[:-1]] == list(range(1, 31))
        assert messages[-1].final.text == "slow"
        assert proc.wait(10) == 0
        outcome = json.loads(proc.stdout.readline())
        assert outcome == {"drained": True, "completed_streams": 1}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
