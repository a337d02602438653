"""`serve --cuda-graph`: the decode worker's batched rounds replay one graph per padded shape bucket.

CI has no GPU, so the served decode worker here runs the same padded buckets eagerly (same buffers, same
padding): concurrent requests must each get the in-process engine's answer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.shared.app import serve
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient

from ..model.tiny_checkpoint import make_tiny_checkpoint

QUESTIONS = ["Where is the old mill?", "Where is the old well?", "Where is the old kiln?"]  # one length
CONTEXT = " ".join(
    f"Record {i}: the ledger of the harbour office lists cargo number {i * 37}." for i in range(40)
)
METHOD = {"chunk_size": 32, "top_k": 2, "gen_length": 8, "steps": 8}


def test_flag_env_and_device_check(tmp_path, monkeypatch) -> None:
    assert serve.build_parser().parse_args([]).cuda_graph is None  # on for CUDA devices, off elsewhere
    monkeypatch.setenv("PDLLM_CUDA_GRAPH", "1")
    assert serve.build_parser().parse_args([]).cuda_graph is True
    assert serve.build_parser().parse_args(["--no-cuda-graph"]).cuda_graph is False
    monkeypatch.setenv("PDLLM_CUDA_GRAPH", "maybe")
    with pytest.raises(ValueError, match="PDLLM_CUDA_GRAPH='maybe'"):
        serve.build_parser()
    monkeypatch.delenv("PDLLM_CUDA_GRAPH")
    tiny_dir = make_tiny_checkpoint(tmp_path / "tiny")
    args = serve.build_parser().parse_args(["--role", "decode", "--model", str(tiny_dir), "--cuda-graph"])
    with pytest.raises(ValueError, match="--cuda-graph needs a CUDA device"):
        serve.start(args)


def test_concurrent_requests_share_round_graphs_and_answer_exactly(tmp_path, monkeypatch) -> None:
    tiny_dir = make_tiny_checkpoint(tmp_path / "tiny")
    forwards: list[GraphedRoundForward] = []

    def padded(args, model, pool):  # what `--cuda-graph` builds on CUDA, run eagerly on CPU
        forwards.append(GraphedRoundForward(model, pool, "torch", capture=False))
        return forwards[-1]

    monkeypatch.setattr(serve, "round_forward", padded)
    args = serve.build_parser().parse_args(
        ["--role", "all", "--model", str(tiny_dir), "--port", "0", "--metrics-port", "-1"]
    )
    deployment = serve.start(args)
    try:
        with PdllmClient(deployment.address, timeout_s=120) as client, ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda q: client.generate(CONTEXT, q, **METHOD).token_ids, QUESTIONS))
    finally:
        deployment.stop()
    loaded = load_model(tiny_dir)
    plain = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(chunk_size=32, top_k=2))
    gen = GenerationConfig(gen_length=8, steps=8)
    for question, got in zip(QUESTIONS, answers, strict=True):
        ids = encode_prompt(loaded.tokenizer, CONTEXT, question)
        assert list(got) == plain.generate(ids.context, ids.query, gen)[0].token_ids, question
    (forward,) = forwards
    # 3 requests x 8 steps: at most one bucket per number of active sessions, reused by every later step
    assert 1 <= forward.captures <= 3 and forward.replays > forward.captures


def test_captured_rounds_refuse_the_torch_attention(tmp_path) -> None:
    """The torch decode attention reads each request's row offsets on the host, which a captured round
    cannot replay (a GPU run crashed inside the capture): the graphed forward refuses it by name."""
    from pdllm.decode_service.kv_pool import DecodeKVPool

    model = load_model(make_tiny_checkpoint(tmp_path / "tiny"), load_tokenizer=False).model
    pool = DecodeKVPool.with_pages(model, 4, 16)
    with pytest.raises(ValueError, match="need the triton decode attention"):
        GraphedRoundForward(model, pool, "torch", capture=True)
    GraphedRoundForward(model, pool, "torch", capture=False)  # the padded buckets, run eagerly: allowed
