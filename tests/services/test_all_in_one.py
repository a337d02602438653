"""`serve --role all` in process: answers equal the in-process engine's, token for token."""

from __future__ import annotations

import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.app.serve import build_parser, start
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient
from tests.reference.vanilla import generate_vanilla

from ..model.tiny_checkpoint import make_tiny_checkpoint

CONTEXT = (
    "The archive reopened after a two-year renovation. Letters, maps and oral histories from local residents. "
    "The access code of Mira Halden is 4821. The reading room holds maps from 1912. "
) * 4
QUESTION = "What is the access code of Mira Halden?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def serve_all(model_dir, *extra: str):  # type: ignore[no-untyped-def]
    """An in-process `serve --role all` of ``model_dir`` on a free port, no metrics endpoint."""
    args = ["--role", "all", "--model", str(model_dir), "--port", "0", "--metrics-port", "-1", *extra]
    return start(build_parser().parse_args(args))


@pytest.fixture(scope="module")
def deployment(tiny_dir):
    dep = serve_all(tiny_dir)
    yield dep
    dep.stop()


def _expected_pdllm(tiny_dir, gen: GenerationConfig, cfg: EngineConfig) -> list[int]:
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, cfg)
    result, _ = engine.generate(ids.context, ids.query, gen)
    return result.token_ids


@pytest.mark.parametrize("kv_mode", ["full-mask", "chunk-query", "chunk-only"])
def test_pdllm_answer_equals_engine(deployment, tiny_dir, kv_mode: str) -> None:
    with PdllmClient(deployment.address) as client:
        response = client.generate(
            context=CONTEXT, question=QUESTION, gen_length=8, steps=8, chunk_size=32, top_k=2, kv_mode=kv_mode
        )
    cfg = EngineConfig(chunk_size=32, top_k=2, kv_mode=kv_mode)
    assert list(response.token_ids) == _expected_pdllm(tiny_dir, GenerationConfig(gen_length=8, steps=8), cfg)
    trace = response.trace
    assert trace.method == "pdllm" and len(trace.selected_chunk_ids) == 2
    assert trace.num_chunks == len(trace.chunk_scores) > 2


def test_vanilla_answer_equals_library(deployment, tiny_dir) -> None:
    with PdllmClient(deployment.address) as client:
        response = client.generate(
            context=CONTEXT, question=QUESTION, gen_length=8, steps=8, method="vanilla"
        )
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    expected = generate_vanilla(loaded.model, ids.vanilla(loaded.config.bos_token_id), GenerationConfig(8, 8))
    assert list(response.token_ids) == expected.token_ids


def test_stream_yields_partials_then_final(deployment) -> None:
    with PdllmClient(deployment.address) as client:
        events = list(client.generate_stream(context=CONTEXT, question=QUESTION, gen_length=8, steps=8))
    partials = [e.partial for e in events if e.HasField("partial")]
    finals = [e.final for e in events if e.HasField("final")]
    assert len(finals) == 1 and len(partials) == 8
    unmasked = [p.unmasked for p in partials]
    assert unmasked == sorted(unmasked) and unmasked[-1] == 8


def test_one_metrics_endpoint_exports_router_workers_and_kv_tier(tiny_dir) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    args = build_parser().parse_args(
        ["--role", "all", "--model", str(tiny_dir), "--port", "0", "--metrics-host", "127.0.0.1",
         "--metrics-port", "0"]
    )  # fmt: skip
    dep = start(args)
    try:
        with PdllmClient(dep.address, timeout_s=60) as client:
            client.generate(CONTEXT, QUESTION, gen_length=4, steps=4, chunk_size=32, top_k=2)
        url = f"http://127.0.0.1:{dep.servers[0].metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        dep.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(families) == len({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")})
    for name in ("pdllm_decode_step_seconds", "pdllm_prefill_chunks", "pdllm_kv_puts", "pdllm_kv_healthy"):
        assert name in families, name
    roles = {s.labels["role"] for s in families["pdllm_rpc_requests"].samples if s.name.endswith("_total")}
    assert roles == {"router", "prefill", "decode"}
    series = [(s.name, tuple(sorted(s.labels.items()))) for f in families.values() for s in f.samples]
    assert len(series) == len(set(series))  # the KV tier both workers share is exported once


def test_fused_prefill_answers_equal_engine(tiny_dir) -> None:
    """``--fused-prefill`` with one chunk per piece: requests arriving together, so pieces of some ride in
    the rounds of others; every answer equals the engine's for its own document."""
    from concurrent.futures import ThreadPoolExecutor

    contexts = [CONTEXT.replace("4821", code) for code in ("4821", "7310", "5562", "9047")]
    gen, cfg = GenerationConfig(gen_length=16, steps=16), EngineConfig(chunk_size=32, top_k=2)
    loaded = load_model(tiny_dir)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, cfg)
    expected = []
    for context in contexts:
        ids = encode_prompt(loaded.tokenizer, context, QUESTION)
        expected.append(engine.generate(ids.context, ids.query, gen)[0].token_ids)
    dep = serve_all(tiny_dir, "--fused-prefill", "--prefill-piece-tokens", "40")
    try:

        def ask(context: str) -> list[int]:
            with PdllmClient(dep.address) as client:
                response = client.generate(
                    context=context, question=QUESTION, gen_length=16, steps=16, chunk_size=32, top_k=2
                )
            return list(response.token_ids)

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, contexts))
    finally:
        dep.stop()
    assert answers == expected
