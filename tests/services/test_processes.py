"""End to end through real processes: router + prefill + decode + redis-server on loopback."""

from __future__ import annotations

import grpc
import pytest

from pdllm.protos.pdllm.v1 import generation_pb2_grpc
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient
from tests.fixtures.redis_server import RedisServer
from tests.rpc.cases import BAD_INPUTS, valid_request
from tests.rpc.fake_generation import MODEL

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .cluster import ServeProcess, worker_args

DOC = (
    "The archive reopened after a two-year renovation. Letters, maps and oral histories from local residents. "
    "The access code of Mira Halden is 4821. The reading room holds maps from 1912. "
) * 5
METHOD = {"chunk_size": 32, "top_k": 2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    redis = RedisServer().start()
    procs: list[ServeProcess] = []
    try:
        prefill = ServeProcess("prefill", worker_args(tiny_dir, redis.url)).start()
        procs.append(prefill)
        decode = ServeProcess("decode", worker_args(tiny_dir, redis.url)).start()
        procs.append(decode)
        router_args = [
            "--model", str(tiny_dir), "--port", "0", "--metrics-port", "0", "--model-name", MODEL,
            "--max-prompt-bytes", "65536", "--prefill-workers", prefill.address, "--decode-workers", decode.address,
        ]  # fmt: skip
        router = ServeProcess("router", router_args).start()
        procs.append(router)
        yield {"prefill": prefill, "decode": decode, "router": router, "redis": redis}
    finally:
        for p in procs:
            p.kill()
        redis.close()


def _engine_answer(tiny_dir, question: str) -> list[int]:
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, DOC, question)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(**METHOD))
    result, _ = engine.generate(ids.context, ids.query, GenerationConfig(gen_length=8, steps=8))
    return result.token_ids


def test_answer_equals_in_process_engine(cluster, tiny_dir) -> None:
    question = "What is the access code of Mira Halden?"
    with PdllmClient(cluster["router"].address, timeout_s=120) as client:
        response = client.generate(DOC, question, model=MODEL, gen_length=8, steps=8, **METHOD)
    assert list(response.token_ids) == _engine_answer(tiny_dir, question)
    assert response.trace.prefill_worker == cluster["prefill"].address  # the address the router used
    assert response.trace.decode_worker == cluster["decode"].address
    # the phase that peaked names what the number measures (CPU: prefill RSS growth or decode KV pages)
    assert response.trace.peak_memory_bytes > 0
    assert response.trace.memory_kind in ("cpu-rss-delta", "kv-pages-plus-build")


def test_a_returning_document_skips_chunk_prefill(cluster, tiny_dir) -> None:
    prefill = cluster["prefill"]
    with PdllmClient(cluster["router"].address, timeout_s=120) as client:
        # Under the default write policy (second-sight) a document's first request stores its top-K, the
        # next one (it finds those) the rest; other tests may have asked about this document already.
        first = client.generate(
            DOC, "Which maps does the reading room hold?", gen_length=8, steps=8, **METHOD
        )
        client.generate(DOC, "Who holds the access code?", gen_length=8, steps=8, **METHOD)
        computed = prefill.metric("pdllm_prefill_chunks_total", 'result="computed"')
        hits = prefill.metric("pdllm_prefill_chunks_total", 'result="hit"')
        written = prefill.metric("pdllm_prefill_chunks_written_total")
        second = client.generate(DOC, "When did the archive reopen?", gen_length=8, steps=8, **METHOD)
    n = first.trace.num_chunks
    assert written >= n  # the whole document went to the tier
    assert prefill.metric("pdllm_prefill_chunks_total", 'result="computed"') == computed
    assert prefill.metric("pdllm_prefill_chunks_total", 'result="hit"') == hits + n
    assert prefill.metric("pdllm_prefill_chunks_written_total") == written
    assert second.trace.cache_hits == n  # every chunk from the store (a time comparison would be flaky)
    assert second.trace.prefill_skipped
    kept = {s.chunk_id: s.kept_tokens for s in second.trace.chunk_scores}
    assert list(second.trace.selected_kept_tokens) == [kept[c] for c in second.trace.selected_chunk_ids]
    assert all(k > 0 for k in second.trace.selected_kept_tokens)
    assert list(second.token_ids) == _engine_answer(tiny_dir, "When did the archive reopen?")


def test_stream_yields_increasing_partials(cluster) -> None:
    with PdllmClient(cluster["router"].address, timeout_s=120) as client:
        events = list(
            client.generate_stream(DOC, "Who holds the access code?", gen_length=8, steps=8, **METHOD)
        )
    partials = [e.partial for e in events if e.HasField("partial")]
    assert [p.step for p in partials] == list(range(1, 9))
    assert [p.unmasked for p in partials] == sorted(p.unmasked for p in partials)
    assert events[-1].HasField("final") and events[-1].final.trace.timings.ttft_s > 0
    assert cluster["decode"].metric("pdllm_decode_step_seconds_count") >= 8


@pytest.mark.parametrize(("kind", "edit", "phrase"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(cluster, kind, edit, phrase) -> None:
    channel = grpc.insecure_channel(cluster["router"].address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = valid_request()
    edit(request)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert phrase in err.value.details()
    ok = valid_request()
    ok.generation.gen_length, ok.generation.steps, ok.generation.block_length = 8, 4, 4
    ok.method.chunk_size = 32
    assert stub.Generate(ok, timeout=60).request_id == "req-1"
    channel.close()
