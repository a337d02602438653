"""KV handoff through real processes: router + prefill + decode on loopback, Gloo (CPU) transport.

The same prefill and decode workers serve two routers, one that builds the decode KV on the prefill worker
(and hands it off) and one that builds it on the decode worker; both must answer exactly like the
in-process engine in every KV mode, and the trace must say where the KV came from.
"""

from __future__ import annotations

import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient
from tests.rpc.fake_generation import MODEL

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .cluster import ServeProcess

DOC = (
    "The archive reopened after a two-year renovation. Letters, maps and oral histories from local residents. "
    "The access code of Mira Halden is 4821. The reading room holds maps from 1912. "
) * 5
QUESTION = "What is the access code of Mira Halden?"
METHOD = {"chunk_size": 32, "top_k": 2}
KV_MODES = ("full-mask", "chunk-query", "chunk-only")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def split(tiny_dir):
    worker = ["--model", str(tiny_dir), "--port", "0", "--metrics-port", "0", "--kv-transfer-backend", "gloo"]
    procs: list[ServeProcess] = []
    try:
        prefill = ServeProcess("prefill", worker).start()
        procs.append(prefill)
        decode = ServeProcess("decode", worker).start()
        procs.append(decode)
        routers = {}
        for side in ("prefill", "decode"):
            args = [
                "--model", str(tiny_dir), "--port", "0", "--metrics-port", "-1", "--model-name", MODEL, "--build-on", side,
                "--prefill-workers", prefill.address, "--decode-workers", decode.address,
            ]  # fmt: skip
            routers[side] = ServeProcess("router", args).start()
            procs.append(routers[side])
        yield {"prefill": prefill, "decode": decode, "routers": routers}
    finally:
        for p in procs:
            p.kill()


def _engine_answer(tiny_dir, kv_mode: str) -> list[int]:
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, DOC, QUESTION)
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_mode=kv_mode, **METHOD))
    result, _ = engine.generate(ids.context, ids.query, GenerationConfig(gen_length=8, steps=8))
    return result.token_ids


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_both_build_placements_answer_like_the_engine(split, tiny_dir, kv_mode: str) -> None:
    expected = _engine_answer(tiny_dir, kv_mode)
    for side, router in split["routers"].items():
        with PdllmClient(router.address, timeout_s=120) as client:
            response = client.generate(
                DOC, QUESTION, model=MODEL, gen_length=8, steps=8, kv_mode=kv_mode, **METHOD
            )
        assert list(response.token_ids) == expected, side
        assert response.trace.kv_source == ("handoff" if side == "prefill" else "built"), side
        assert (response.trace.timings.handoff_s > 0) == (side == "prefill")


def test_handoffs_are_counted_on_both_sides(split) -> None:
    prefill, decode = split["prefill"], split["decode"]
    sent = prefill.metric("pdllm_kv_handoff_offers_total", 'outcome="sent"')
    pulled = decode.metric("pdllm_kv_handoff_pulls_total", 'outcome="done"')
    with PdllmClient(split["routers"]["prefill"].address, timeout_s=120) as client:
        client.generate(
            DOC, "Which maps does the reading room hold?", model=MODEL, gen_length=8, steps=8, **METHOD
        )
    assert prefill.metric("pdllm_kv_handoff_offers_total", 'outcome="sent"') == sent + 1
    assert decode.metric("pdllm_kv_handoff_pulls_total", 'outcome="done"') == pulled + 1
    assert prefill.metric("pdllm_kv_handoff_held_bytes") == 0  # nothing left behind once pulled
