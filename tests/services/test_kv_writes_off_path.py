"""With ``--kv-url``, chunk-KV writes stay off the request path (time to first token with the
Redis tier stays that of the run without it).

A timing comparison would be flaky on a shared CI host, so the test makes the difference unmissable
instead: every Redis SET blocks until the test opens a gate (for up to ``HOLD_S``), and the gate stays
shut until the request has streamed its last token. The request must finish in a fraction of
``HOLD_S`` (a write on the device thread would stall it for all of ``HOLD_S``), and every Redis write must
have run on the background writer's thread. Afterwards Redis must hold what the default write policy
writes for a document seen once: the request's top-K chunks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import redis
import torch

from pdllm.shared.app.serve import build_parser, start
from pdllm.shared.kv_tier.redis_store import RedisStore
from pdllm.shared.rpc.client import PdllmClient

from ..model.tiny_checkpoint import make_tiny_checkpoint

HOLD_S = 60.0  # how long a Redis write blocks unless the gate opens first (the bound is a third)
CONTEXT = (
    "The archive reopened after a two-year renovation. Letters, maps and oral histories from local residents. "
    "The access code of Mira Halden is 4821. The reading room holds maps from 1912. "
) * 4
QUESTION = "What is the access code of Mira Halden?"
TOP_K = 2


def test_first_token_does_not_wait_for_redis_writes(
    redis_server: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    writers: list[str] = []
    real_put = RedisStore.put_many

    def gated_put(self: RedisStore, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        writers.append(threading.current_thread().name)
        gate.wait(HOLD_S)
        return real_put(self, items)

    monkeypatch.setattr(RedisStore, "put_many", gated_put)
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    argv = ["--role", "all", "--model", str(tiny), "--port", "0", "--metrics-port", "-1"]
    deployment = start(build_parser().parse_args([*argv, "--kv-url", redis_server]))
    try:
        start_s = time.perf_counter()
        first_token_s = final = None
        with PdllmClient(deployment.address, timeout_s=HOLD_S) as client:
            stream = client.generate_stream(
                CONTEXT, QUESTION, gen_length=8, steps=8, chunk_size=32, top_k=TOP_K
            )
            for event in stream:
                if first_token_s is None and event.HasField("partial"):
                    first_token_s = time.perf_counter() - start_s
                if event.HasField("final"):
                    final = event.final
        total_s = time.perf_counter() - start_s
        gate.set()  # only now may the writes reach Redis
        assert first_token_s is not None and total_s < HOLD_S / 3, (
            f"first token after {first_token_s} s, last after {total_s:.2f} s: a Redis write held it"
        )
        assert final is not None and final.trace.num_chunks > TOP_K
        # The writes did happen, on the background writer's thread only, and are what a document seen
        # once gets under the default policy: its top-K chunks.
        client_r = redis.Redis.from_url(redis_server)
        deadline = time.monotonic() + 20
        while client_r.dbsize() < TOP_K and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client_r.dbsize() == TOP_K
        assert writers and set(writers) == {"kv-writer"}, writers
    finally:
        gate.set()
        deployment.stop()
