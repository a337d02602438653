"""Load and faults through real processes: 50 concurrent streams, Redis killed, corrupt KV, a decode
worker killed mid-stream, the router restarted. Each request loop is bounded in count and time."""

from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest
import redis

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import PdllmError
from tests.fixtures.redis_server import RedisServer

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .cluster import ServeProcess, worker_args

METHOD = {"chunk_size": 32, "top_k": 2}


def doc(tag: str) -> str:
    return (
        f"Report {tag}. The archive reopened after a two-year renovation. The access code of Mira Halden is 4821. "
        "Letters, maps and oral histories from local residents fill the reading room. "
    ) * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    loaded = load_model(tiny_dir)
    return loaded, PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(**METHOD))


def expected(engine, context: str, question: str, gen: int = 8) -> list[int]:
    loaded, eng = engine
    ids = encode_prompt(loaded.tokenizer, context, question)
    return eng.generate(ids.context, ids.query, GenerationConfig(gen_length=gen, steps=gen))[0].token_ids


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    store = RedisServer().start()
    procs: list[ServeProcess] = []
    try:
        # Redis is the prefill worker's only tier, so what Redis holds (or loses, or garbles) matters.
        prefill = ServeProcess("prefill", worker_args(tiny_dir, store.url, ["--kv-cpu-bytes", "0"])).start()
        decodes = [ServeProcess("decode", worker_args(tiny_dir, store.url)).start() for _ in range(2)]
        procs += [prefill, *decodes]
        router_args = [
            "--model", str(tiny_dir), "--port", "0", "--metrics-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", ",".join(d.address for d in decodes),
        ]  # fmt: skip
        router = ServeProcess("router", router_args).start()
        procs.append(router)
        yield {"prefill": prefill, "decodes": decodes, "router": router, "redis": store, "procs": procs}
    finally:
        for p in procs:
            p.kill()
        store.close()


def test_fifty_concurrent_streams(cluster, engine) -> None:
    docs = {f"d{i}": doc(f"d{i}") for i in range(5)}
    want = {
        tag: expected(engine, text, "What is the access code of Mira Halden?") for tag, text in docs.items()
    }
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        tag = f"d{i % 5}"
        start = time.perf_counter()
        try:
            with PdllmClient(cluster["router"].address, timeout_s=120) as client:
                events = list(
                    client.generate_stream(
                        docs[tag], "What is the access code of Mira Halden?", gen_length=8, steps=8, **METHOD
                    )
                )
            final = events[-1].final
            ok = events[-1].HasField("final") and list(final.token_ids) == want[tag]
            with lock:
                (latencies if ok else failures).append(
                    time.perf_counter() - start if ok else f"{i}: wrong answer"
                )
        except Exception as exc:  # every failure is a finding; collect them all
            with lock:
                failures.append(f"{i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "streams still running after 180 s"
    assert failures == []
    assert len(latencies) == 50
    q = statistics.quantiles(latencies, n=100, method="inclusive")  # never beyond the max
    # Concurrent requests shared batched chunk prefills on the prefill worker (cross-request batching).
    batched = cluster["prefill"].metric("pdllm_prefill_batch_requests_sum")
    batches = cluster["prefill"].metric("pdllm_prefill_batch_requests_count")
    assert batched >= 50 and batches < batched
    print(
        f"\n50 concurrent streams: p50 {q[49]:.2f}s p99 {q[98]:.2f}s max {max(latencies):.2f}s; "
        f"{batched:.0f} prefills in {batches:.0f} batches"
    )


def test_redis_killed_requests_still_answered(cluster, engine) -> None:
    cluster["redis"].kill()
    try:
        with PdllmClient(cluster["router"].address, timeout_s=120) as client:
            for tag in ("r1", "r2"):
                response = client.generate(doc(tag), "Where are the maps?", gen_length=8, steps=8, **METHOD)
                assert list(response.token_ids) == expected(engine, doc(tag), "Where are the maps?")
        assert cluster["prefill"].metric("pdllm_kv_healthy") == 0
    finally:
        cluster["redis"].restart()


def test_corrupted_kv_values_are_detected_and_recomputed(cluster, engine) -> None:
    prefill, text = cluster["prefill"], doc("corrupt")
    with PdllmClient(cluster["router"].address, timeout_s=120) as client:
        r = redis.Redis.from_url(cluster["redis"].url)
        # A Redis restarted by the previous test is retried after the store's back-off window.
        for _ in range(20):
            first = client.generate(text, "Who renovated the archive?", gen_length=8, steps=8, **METHOD)
            keys = r.keys("*")
            if keys:
                break
            time.sleep(0.5)
        assert keys, "prefill stored nothing in Redis"
        for key in keys:
            value = bytearray(r.get(key))
            value[len(value) // 2] ^= 0xFF
            r.set(key, bytes(value))
        computed = prefill.metric("pdllm_prefill_chunks_total", 'result="computed"')
        second = client.generate(text, "What fills the reading room?", gen_length=8, steps=8, **METHOD)
    n = first.trace.num_chunks
    assert prefill.metric("pdllm_prefill_chunks_total", 'result="computed"') == computed + n
    assert list(second.token_ids) == expected(engine, text, "What fills the reading room?")


def test_decode_worker_killed_mid_stream_finishes_elsewhere(cluster, engine) -> None:
    text, question = doc("kill"), "What is the access code of Mira Halden?"
    with PdllmClient(cluster["router"].address, timeout_s=120) as client:
        stream = client.generate_stream(text, question, gen_length=64, steps=64, **METHOD)
        first = next(iter(stream))
        assert first.HasField("partial")
        busy = [d for d in cluster["decodes"] if d.metric("pdllm_rpc_in_flight") > 0]
        assert len(busy) == 1
        busy[0].kill()
        events = list(stream)
    final = events[-1].final
    assert events[-1].HasField("final")
    survivor = next(d for d in cluster["decodes"] if d is not busy[0])
    assert final.trace.decode_worker and survivor.proc.poll() is None
    assert list(final.token_ids) == expected(engine, text, question, gen=64)


def test_router_restart_gives_clean_errors_then_serves(cluster, tiny_dir) -> None:
    router = cluster["router"]
    router.kill()
    start = time.perf_counter()
    with pytest.raises(PdllmError) as err, PdllmClient(router.address, timeout_s=10) as client:
        client.generate(doc("x"), "Where are the maps?", gen_length=8, steps=8, **METHOD)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.perf_counter() - start < 10
    restarted = ServeProcess("router", router.args).start()
    cluster["procs"].append(restarted)
    with PdllmClient(restarted.address, timeout_s=120) as client:
        assert client.generate(doc("x"), "Where are the maps?", gen_length=8, steps=8, **METHOD).token_ids
