"""Compute-skipping decode policies (DyLLM, FOCUS) against plain decoding: tokens/s and rows computed.

    python benchmarks/decode_compute_skip.py --out benchmarks/results           # GPU: 7B/8B shapes, bf16
    python benchmarks/decode_compute_skip.py --smoke --out /tmp/compute_skip    # CPU: tiny, seconds
    python benchmarks/decode_compute_skip.py --merge benchmarks/results/decode_compute_skip.json
        # put a run's rows into benchmarks/results/decode_policies.json (replacing earlier ones of this script)

``--method vanilla`` on a 1K-token prompt (BOS + context + 24-token question), block 32, one token per step
(steps = gen length: the same count for every policy; random weights make a confidence threshold
meaningless), greedy, no EOS stop.

* **Batch 1, Dream-7B shapes**, gen ``--gen`` (256): ``none`` (the plain eager loop, the ``vanilla``
  baseline), ``dual-cache`` (its eager reference loop, the ``dual_cache`` baseline; the decode worker's
  batched rounds are ``decode_policy_rounds.py``'s), ``dyllm`` eager and with CUDA graphs (its fast path;
  graphs as the decode worker and engine run it; each run captures its own, counted in the time), ``focus``
  (its reference request loop).
* **Batches 1 / 16 / 64, SDAR-8B shapes** (Qwen3-8B layout, model block 4, generation block 32), gen
  ``--batch-gen`` (64): FOCUS's batched fast path (``generate_focus_batched``: one packed forward per step for
  every request) against the same packed forward with nothing evicted and no delayed cache (budget = block:
  plain decoding, token for token, as the tests hold), which is this row's ``plain batched`` baseline.

Random weights make the policies' choices arbitrary (which rows are salient, which tokens look decodable), so
the rows each computed are reported beside the speed: ``rows_frac`` = rows the policy ran through its
skipping layers / rows plain decoding would have. Every run is preceded by a one-block warm-up of the same
configuration; tokens/s = batch x gen / seconds of the timed run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids  # noqa: E402
from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.shared.generation.policies import DecodePolicyConfig  # noqa: E402
from pdllm.shared.generation.policies.compute_skip import run_compute_skip, vanilla_compute_skip_logits  # noqa: E402
from pdllm.shared.generation.policies.focus import FocusConfig  # noqa: E402
from pdllm.shared.generation.policies.focus_batch import generate_focus_batched  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.generation.vanilla import generate_vanilla, prompt_tensor  # noqa: E402
from pdllm.shared.model.config import ModelConfig  # noqa: E402
from pdllm.shared.model.transformer import DiffusionLM  # noqa: E402

ROW_KEYS = ("policy", "method", "context_tokens", "gen_length", "batch", "tokens_per_s",
            "speedup_vs_vanilla", "speedup_vs_dual_cache", "peak_gib")  # fmt: skip
SOURCE = "decode_compute_skip"
SINGLE = ("none", "dual-cache", "dyllm", "dyllm+graphs", "focus")  # batch-1 Dream runs, baselines first


def sdar8b(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(
            family="sdar", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=8192, mask_token_id=511, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, block_size=4, model_id="tiny-sdar",
        )  # fmt: skip
    return ModelConfig(
        family="sdar", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
        mask_token_id=151669, bos_token_id=151643, eos_token_id=151643, pad_token_id=151643, block_size=4,
        model_id="sdar8b-shapes-random",
    )  # fmt: skip


def _gen(gen: int, block: int) -> GenerationConfig:
    return GenerationConfig(gen_length=gen, steps=gen, block_length=block, stop_at_eos=False)


def _timed(device: torch.device, fn) -> tuple[float, float, object]:  # type: ignore[no-untyped-def]
    """Seconds, CUDA peak GiB (0 on CPU) and result of ``fn()``."""
    if device.type == "cuda":
        gc.collect()  # the previous run's caches and graphs
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        print(
            f"[mem] {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated before the run",
            flush=True,
        )
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return seconds, peak, result


def single(model: DiffusionLM, prompt: list[int], name: str, gen: GenerationConfig) -> tuple[dict, object]:
    """One batch-1 decode under ``name``: (cache counters plus graph count, result tokens)."""
    if name == "dyllm+graphs":
        with torch.inference_mode():
            policy = DecodePolicyConfig("dyllm")
            fn = vanilla_compute_skip_logits(
                model, prompt_tensor(model, prompt), gen, policy, cuda_graph=True
            )
            result = run_compute_skip(fn)
        return {**result.cache, "graphs_captured": len(fn.graphs)}, result.raw_tokens  # type: ignore[union-attr]
    result = generate_vanilla(model, prompt, gen, policy=DecodePolicyConfig(name))
    return dict(result.cache or {}), result.raw_tokens


def rows_frac(cache: dict) -> float | None:
    counters = {**cache, **cache.get("counters", {})} if cache else {}
    total = counters.get("rows_total") or counters.get("rows_plain")
    done = counters.get("rows_forwarded")
    return done / total if total and done is not None else None


def run_single(model: DiffusionLM, shapes: ModelConfig, args: argparse.Namespace, rows: list[dict]) -> None:
    device = next(model.parameters()).device
    rng = torch.Generator().manual_seed(0)
    prompt = [shapes.bos_token_id, *random_ids(args.context + QUERY_TOKENS, shapes.vocab_size, rng)]
    tokens: dict[str, object] = {}
    for name in SINGLE if device.type == "cuda" else [n for n in SINGLE if n != "dyllm+graphs"]:
        try:
            single(model, prompt, name, _gen(args.block, args.block))  # warm-up: one block
            seconds, peak, (cache, tokens[name]) = _timed(
                device, lambda name=name: single(model, prompt, name, _gen(args.gen, args.block))
            )
        except Exception as exc:  # recorded; the rest still runs
            rows.append({"model": shapes.model_id, "policy": name, "batch": 1, "error": f"{exc!r}"[:300]})
            print(f"[error] {rows[-1]}", flush=True)
            continue
        row = {"model": shapes.model_id, "policy": name, "method": "vanilla", "context_tokens": args.context,
               "gen_length": args.gen, "batch": 1, "tokens_per_s": args.gen / seconds, "peak_gib": peak,
               "rows_frac": rows_frac(cache), "cache": cache, "source": SOURCE}  # fmt: skip
        if name == "dyllm+graphs" and "dyllm" in tokens:
            row["same_tokens_as_eager"] = tokens[name] == tokens["dyllm"]
        rows.append(row)
        print(f"[done] {json.dumps(row)}", flush=True)


def run_batched(model: DiffusionLM, shapes: ModelConfig, args: argparse.Namespace, rows: list[dict]) -> None:
    device = next(model.parameters()).device
    rng = torch.Generator().manual_seed(1)
    plain = FocusConfig(budget=args.block, delayed_cache=False)
    for batch in args.batches:
        prompts = [
            [shapes.bos_token_id, *random_ids(args.context + QUERY_TOKENS, shapes.vocab_size, rng)]
            for _ in range(batch)
        ]
        for name, focus in (("plain-batched", plain), ("focus", FocusConfig())):
            try:
                generate_focus_batched(model, prompts, _gen(args.block, args.block), focus)  # warm-up
                gen = _gen(args.batch_gen, args.block)
                seconds, peak, results = _timed(
                    device, lambda f=focus, g=gen, p=prompts: generate_focus_batched(model, p, g, f)
                )
            except Exception as exc:
                rows.append(
                    {"model": shapes.model_id, "policy": name, "batch": batch, "error": f"{exc!r}"[:300]}
                )
                print(f"[error] {rows[-1]}", flush=True)
                continue
            done = sum(r.cache["rows_forwarded"] for r in results)  # type: ignore[union-attr]
            total = sum(r.cache["rows_plain"] for r in results)  # type: ignore[union-attr]
            row = {"model": shapes.model_id, "policy": name, "method": "vanilla",
                   "context_tokens": args.context, "gen_length": args.batch_gen, "batch": batch,
                   "tokens_per_s": batch * args.batch_gen / seconds, "peak_gib": peak,
                   "rows_frac": done / total if total else None, "batched": True, "source": SOURCE}  # fmt: skip
            rows.append(row)
            print(f"[done] {json.dumps(row)}", flush=True)


def ratios(rows: list[dict]) -> None:
    """``speedup_vs_vanilla``: vs ``none`` (batch 1) or ``plain-batched`` (same batch); ``speedup_vs_dual_cache``:
    vs the batch-1 dual cache of the same model (None where that was not run)."""

    def speed(model: str, policy: str, batch: int) -> float | None:
        for r in rows:
            if (r["model"], r["policy"], r["batch"]) == (model, policy, batch) and "tokens_per_s" in r:
                return r["tokens_per_s"]
        return None

    for r in rows:
        if "tokens_per_s" not in r:
            continue
        base = speed(r["model"], "plain-batched" if r.get("batched") else "none", r["batch"])
        dual = speed(r["model"], "dual-cache", 1) if r["batch"] == 1 else None
        r["speedup_vs_vanilla"] = r["tokens_per_s"] / base if base else None
        r["speedup_vs_dual_cache"] = r["tokens_per_s"] / dual if dual else None


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(report: dict) -> str:
    lines = [
        "# Compute-skipping decode policies vs plain decoding",
        "",
        f"{report['device']}, {report['date']}, `{report['command']}`",
        "",
        "| model | policy | batch | gen | tokens/s | vs vanilla / plain batched | vs dual cache | rows computed / plain | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['policy']} | {r['batch']} | | error: {r['error'][:80]} | | | | |"
            )
            continue
        frac = "—" if r.get("rows_frac") is None else f"{r['rows_frac']:.2f}"
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['batch']} | {r['gen_length']} | {r['tokens_per_s']:.1f} "
            f"| {_x(r['speedup_vs_vanilla'])} | {_x(r['speedup_vs_dual_cache'])} | {frac} | {r['peak_gib']:.1f} |"
        )
    graphs = [r for r in report["rows"] if r["policy"] == "dyllm+graphs" and "cache" in r]
    for r in graphs:
        lines += ["", f"dyllm+graphs captured {r['cache']['graphs_captured']} graphs in the timed run (included); "
                  f"same tokens as the eager fast path: {r.get('same_tokens_as_eager')}."]  # fmt: skip
    lines += ["", report["setup"]]
    return "\n".join(lines) + "\n"


MARK = "<!-- rows from benchmarks/decode_compute_skip.py -->"


def merge(path: Path, into: Path) -> None:
    """Replace ``into``'s rows from this script with ``path``'s (schema rows only), keeping its meta; the
    Markdown beside it gets this run's table after :data:`MARK` (replacing an earlier one)."""
    run, target = json.loads(path.read_text()), json.loads(into.read_text())
    kept = [r for r in target["rows"] if r.get("source") != SOURCE]
    new = [{k: r.get(k) for k in (*ROW_KEYS, "model", "source")} for r in run["rows"] if "tokens_per_s" in r]
    target["rows"] = kept + new
    target.setdefault("meta", {})[SOURCE] = {k: run[k] for k in ("device", "date", "command", "setup")}
    into.write_text(json.dumps(target, indent=2) + "\n")
    md = into.with_suffix(".md")
    text = md.read_text().split(MARK)[0].rstrip("\n")
    table = markdown(run).replace("# Compute-skipping", "## Compute-skipping", 1)
    md.write_text(f"{text}\n\n{MARK}\n{table}")
    print(f"{into}: {len(kept)} rows kept, {len(new)} from {path}; {md} updated")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--gen", type=int, default=None, help="batch-1 gen length (GPU default 256)")
    ap.add_argument("--batch-gen", type=int, default=None, help="batched gen length (GPU default 64)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="SDAR batches (GPU: 1 16 64)")
    ap.add_argument("--context", type=int, default=None, help="prompt context tokens (GPU default 1024)")
    ap.add_argument("--parts", nargs="+", choices=("single", "batched"), default=["single", "batched"])
    ap.add_argument(
        "--merge", type=Path, default=None, help="a run's JSON to merge into decode_policies.json"
    )
    args = ap.parse_args(argv)
    if args.merge is not None:
        merge(args.merge, args.merge.parent / "decode_policies.json")
        return 0
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    args.block = 32 if cuda else 8
    args.context = args.context or (1024 if cuda else 64)
    args.gen = args.gen or (256 if cuda else 16)
    args.batch_gen = args.batch_gen or (64 if cuda else 16)
    args.batches = args.batches or ([1, 16, 64] if cuda else [1, 3])
    rows: list[dict] = []
    if "single" in args.parts:
        dream = dream7b() if cuda else tiny()
        run_single(build_model(dream, device, dtype), dream, args, rows)
    if "batched" in args.parts:
        sdar = sdar8b(not cuda)
        run_batched(build_model(sdar, device, dtype), sdar, args, rows)
    ratios(rows)
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_compute_skip.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "setup": f"{dtype}, prompt {args.context} context + {QUERY_TOKENS} question tokens, block {args.block}, "
        f"one token per step, greedy; batch 1: Dream shapes, gen {args.gen}; batches {args.batches}: SDAR "
        f"shapes, gen {args.batch_gen}. Peak GiB: CUDA allocator peak, weights included (0 on CPU).",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "decode_compute_skip" if cuda else "decode_compute_skip_smoke"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
