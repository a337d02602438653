"""Run under TRITON_INTERPRET=1 (by test_triton_decode.py): the engine's rounds with the Triton split-S
kernel == its torch reference == the segmented reference loop, with no policy and under a dual cache."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdllm.shared.app.engine import PrefillingEngine  # noqa: E402
from pdllm.shared.config import EngineConfig  # noqa: E402
from pdllm.shared.decode_policy import DecodePolicyConfig  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from tests.engine.helpers import model, tokens  # noqa: E402
from tests.reference.static_kv import StaticPolicy, decode  # noqa: E402


def main() -> None:
    gen = GenerationConfig(gen_length=4, steps=2)
    for family, kv_mode, top_b in [("llada", "chunk-only", 5)]:
        cfg = EngineConfig(chunk_size=12, top_k=2, kv_mode=kv_mode, top_b=top_b)
        m = model(family)
        outs = []
        for mode in ("torch", "triton"):
            engine = PrefillingEngine(m, None, cfg, decode_attention=mode, reuse_chunks=False)
            result, _ = engine.generate(tokens(40, 1), tokens(5, 2), gen, [5, 6])
            outs.append(result.raw_tokens)
        if outs[0] != outs[1]:
            raise SystemExit(f"{family} {kv_mode}: triton {outs[1]} != torch {outs[0]}")
    # A second request of the same shape replays the rounds' bucket (the padded path, eager off CUDA).
    cfg = EngineConfig(chunk_size=12, top_k=2)
    m = model("dream")
    cached = PrefillingEngine(m, None, cfg, decode_attention="triton", reuse_chunks=False, cuda_graph=True)
    plain = PrefillingEngine(m, None, cfg, decode_attention="torch", reuse_chunks=False)
    for doc in (1, 2):
        got, _ = cached.generate(tokens(48, doc), tokens(5, 10 + doc), gen)
        sel = plain.prefill(tokens(48, doc), tokens(5, 10 + doc), gen)
        want = decode(m, sel.request.query, plain.build(sel, gen), gen, StaticPolicy("segments"))
        if got.raw_tokens != want.raw_tokens:
            raise SystemExit(f"graphed rounds (triton) doc {doc}: {got.raw_tokens} != {want.raw_tokens}")
    forward = cached.decode_worker.local.forward
    if forward is None or forward.captures != 1:
        raise SystemExit("the second request did not reuse the first one's bucket")
    # Under a dual cache a cached step forwards fewer rows than the cache holds; the kernel reads the rest
    # as pages.
    dual = DecodePolicyConfig("dual-cache")
    outs = []
    for mode in ("torch", "triton"):
        engine = PrefillingEngine(m, None, cfg, decode_attention=mode, reuse_chunks=False)
        result, _ = engine.generate(tokens(48, 3), tokens(5, 13), gen, decode_policy=dual)
        outs.append(result.raw_tokens)
    if outs[0] != outs[1]:
        raise SystemExit(f"dual cache: triton {outs[1]} != torch {outs[0]}")
    print("ok")


if __name__ == "__main__":
    main()
