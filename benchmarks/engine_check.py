"""GPU token equivalence of the decode engine: what ``generate`` / ``eval`` run (the decode server's rounds,
driven in process: eager and graphed, Triton split-S on CUDA) against the reference loops, on tiny fp32
models with peaked random weights.

    python benchmarks/engine_check.py --out benchmarks/results     # on the GPU machine
    python benchmarks/engine_check.py --smoke --out /tmp/check     # CPU: the same cases, torch attention

Cases: Dream and LLaDA; pdllm and vanilla requests; no decode policy, prefix / dual cache, Sparse-dLLM,
Polestar-Cache; fixed-step greedy, threshold and sampled generation. Reference per case: pdllm without a
policy -> the segmented-attention loop (``tests/reference/static_kv.decode``), pdllm
under a policy -> the policy's reference loop over the static KV (``tests/reference/static_kv.py``), vanilla
-> ``generate_vanilla`` (``tests/reference/vanilla.py``). Writes engine_check.json and engine_check.md
(cases equal / total, and any mismatch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from pdllm.decode_service.policies import DecodePolicyConfig, make_policy
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.config import ModelConfig
from pdllm.shared.model.transformer import DiffusionLM

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the reference loops (tests/reference) importable
    sys.path.insert(0, str(ROOT))

from tests.reference.policy import run_policy  # noqa: E402
from tests.reference.static_kv import StaticPolicy, decode, static_policy_logits  # noqa: E402
from tests.reference.vanilla import generate_vanilla  # noqa: E402

POLICIES = ("none", "prefix-cache", "dual-cache", "sparse-dllm", "polestar")
GENS = {
    "greedy": GenerationConfig(gen_length=8, steps=8, block_length=4),
    "threshold": GenerationConfig(gen_length=8, steps=8, block_length=4, threshold=0.4),
    "sampled": GenerationConfig(gen_length=6, steps=3, temperature=0.9, seed=5),
}


def tiny(family: str, device: torch.device) -> DiffusionLM:
    config = ModelConfig(
        family=family, vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=512, attention_bias=family == "dream",
        shift_logits=family == "dream", mask_token_id=96, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = DiffusionLM(config)
    model.init_weights(0, std=0.2)  # peaked logits: no argmax decided by rounding
    return model.to(device).eval()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_pdllm(engine: PrefillingEngine, context: list[int], query: list[int], gen, policy) -> list[int]:  # type: ignore[no-untyped-def]
    sel = engine.prefill(context, query, gen)
    static = engine.build(sel, gen)
    if policy.name == "none":
        return decode(engine.model, sel.request.query, static, gen, StaticPolicy("segments")).raw_tokens
    cache = make_policy(policy)
    assert cache is not None
    loop = static_policy_logits(engine.model, sel.request.query, static, gen, cache, "segments")
    return run_policy(loop).raw_tokens


def check(device: torch.device) -> list[dict]:
    rows = []
    for family in ("dream", "llada"):
        model = tiny(family, device)
        graphed = device.type == "cuda"
        engine = PrefillingEngine(
            model, None, EngineConfig(chunk_size=12, top_k=2), reuse_chunks=False, cuda_graph=graphed
        )
        eager = PrefillingEngine(model, None, EngineConfig(chunk_size=12, top_k=2), reuse_chunks=False)
        reference = PrefillingEngine(model, None, EngineConfig(chunk_size=12, top_k=2), reuse_chunks=False)
        for name in POLICIES:
            policy = DecodePolicyConfig(name=name)
            decode_policy = None if name == "none" else policy
            for gen_name, gen in GENS.items():
                for seed in (0, 1):
                    context, query = ids(48, 10 + seed), ids(5, 20 + seed)
                    want = reference_pdllm(reference, context, query, gen, policy)
                    for kind, eng in (("graphed" if graphed else "padded", engine), ("eager", eager)):
                        got = eng.generate(context, query, gen, decode_policy=decode_policy)[0].raw_tokens
                        rows.append(_row(family, "pdllm", name, gen_name, seed, kind, got, want))
                    prompt = [1, *ids(14 + seed, 30 + seed)]
                    want = generate_vanilla(model, prompt, gen, policy=decode_policy).raw_tokens
                    got = engine.decode_worker.vanilla(prompt, gen, decode_policy).raw_tokens
                    rows.append(
                        _row(
                            family,
                            "vanilla",
                            name,
                            gen_name,
                            seed,
                            "graphed" if graphed else "padded",
                            got,
                            want,
                        )
                    )
    return rows


def _row(family: str, method: str, policy: str, gen: str, seed: int, kind: str, got: list[int], want: list[int]) -> dict:  # fmt: skip
    return {"family": family, "method": method, "policy": policy, "gen": gen, "seed": seed, "rounds": kind,
            "equal": got == want, "got": got, "want": want}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: the same cases with the torch attention")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    with torch.inference_mode():
        rows = check(device)
    equal = sum(r["equal"] for r in rows)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "equal": equal,
        "total": len(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Decode engine vs reference loops — {meta['device']}, {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        f"**{equal} / {len(rows)}** cases token-equal (tiny fp32 models; Dream and LLaDA; pdllm and vanilla; "
        f"policies {', '.join(POLICIES)}; generation {', '.join(GENS)}).",
    ]
    bad = [r for r in rows if not r["equal"]]
    if bad:
        lines += [
            "",
            "| family | method | policy | gen | seed | rounds | got | want |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {r['family']} | {r['method']} | {r['policy']} | {r['gen']} | {r['seed']} | {r['rounds']} | "
                  f"{r['got']} | {r['want']} |" for r in bad]  # fmt: skip
    (args.out / "engine_check.md").write_text("\n".join(lines) + "\n")
    print(f"{equal} / {len(rows)} equal")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
