"""Chunk-prefill attention and top-B retention: what the serving paths run today against the kernels.

Chunk prefill (step 3, ``shared/chunk_prefill.py``): one layer's attention over a batch of chunks of BOS + C
tokens, Dream-7B heads, batched as the workers batch them. ``piece``: ``--role all`` (at most 2048 tokens a
forward, ``--prefill-piece-tokens``); ``batch``: ``--role prefill`` (``prefill_batch`` = 64 chunks of one
length); ``tail``: 64 chunks whose last 8 are requests' shorter last chunks (padded); all causal, as the
prefill worker runs. ``bidir`` / ``bidir-tail``: the decode worker's chunk-only recompute with
``prefill_attention="bidirectional"`` (top-K = 4 chunks; in ``bidir-tail`` one is shorter). ``sdpa`` is
today's ``DenseAttention`` on the padded batch; ``varlen`` is ``VarlenAttention``
(``kernels/chunk_prefill_attention``: one batched SDPA without a mask when no chunk is padded, else flash
varlen on the packed tokens). ``worker`` rows: the whole step 3 (``chunk_prefill``, Dream-7B with random
weights, 28 layers) of one request with a 16000-token context (the last chunk short), per kernel.

Retention (top-B scores of the decode build, ``decode_service/build.py``): one layer of the build forward over
instruction + K = 4 chunks + query (+ the masked response in full-mask), attention output included.
``probe`` is today's ``RetentionProbe``; ``kernel`` is ``KernelRetentionProbe`` (flash LSE +
``kernels/retention_scores``). ``diff`` compares the scores; ``top_b_agree`` is the share of the tokens kept
at B = 512 (the paper's budget) that both pick.

Eager timing (the workers run these forwards eagerly): CUDA events, median of ``--reps``. ``ratio`` is the
latency over today's. Writes prefill_kernels.json and .md under ``--out``. ``--smoke``: CPU, tiny shapes,
Triton's interpreter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from pdllm.decode_service.build import KernelRetentionProbe, RetentionProbe
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.layout import keep_top_b
from pdllm.shared.model.attention import AttentionBackend, DenseAttention, VarlenAttention
from pdllm.shared.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import build_model, dream7b, tiny  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    model: ModelConfig
    chunk_sizes: tuple[int, ...]
    piece_tokens: int  # --prefill-piece-tokens default
    batch: int  # EngineConfig.prefill_batch default
    short: int  # short last chunks in a `tail` batch
    top_k: int
    instruction: int
    query: int
    gen: int
    top_b: int
    context: int  # tokens of the `worker` rows' request
    dtype: torch.dtype


FULL = Shapes(dream7b(), (256, 512, 1024, 2048), 2048, 64, 8, 4, 32, 64, 256, 512, 16000, torch.bfloat16)
# 90 context tokens: the worker rows' one group holds a short last chunk (padded) at both sizes.
SMOKE = Shapes(tiny(), (16, 32), 64, 6, 2, 3, 4, 8, 8, 8, 90, torch.float32)


def time_us(fn: Callable[[], object], reps: int, device: torch.device, inner: int = 3) -> float:
    """Median microseconds of one ``fn()`` (eager; ``inner`` calls per sample)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / inner)
        else:
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t) * 1e6 / inner)
    return statistics.median(times)


def model_qkv(s: Shapes, b: int, t: int, gen: torch.Generator, device: torch.device) -> list[torch.Tensor]:
    """q, k, v ``[B, H, T, D]`` laid out as the model hands them over: q, k token-major (RoPE's output), v a
    slice of the fused qkv projection."""
    hq, hkv, d = s.model.num_heads, s.model.num_kv_heads, s.model.head_dim
    q = torch.randn(b, t, hq, d, generator=gen, device=device, dtype=s.dtype)
    k = torch.randn(b, t, hkv, d, generator=gen, device=device, dtype=s.dtype)
    qkv = torch.randn(b, t, hq + 2 * hkv, d, generator=gen, device=device, dtype=s.dtype)
    return [x.transpose(1, 2) for x in (q, k, qkv[:, :, hq + hkv :])]


def timed_pair(kind: str, shape: str, impls: dict[str, Callable[[], object]], reps: int,
               device: torch.device, extra: dict, inner: int = 3) -> list[dict]:  # fmt: skip
    """Rows for today's implementation (the first) and the kernel's; ``extra`` goes on the kernel's."""
    rows, base = [], 0.0
    for i, (name, fn) in enumerate(impls.items()):
        us = time_us(fn, reps, device, inner)
        base = base or us
        rows.append({"kind": kind, "shape": shape, "impl": name, "latency_us": us, "ratio": us / base,
                     **(extra if i else {})})  # fmt: skip
        print(f"{kind:13s} {shape:44s} {name:7s} {us:11.1f} us  x{us / base:.2f}  {extra if i else ''}")
    return rows


def chunk_case(s: Shapes, c: int, regime: str, lens: list[int], causal: bool, reps: int,
               device: torch.device) -> list[dict]:  # fmt: skip
    b, t = len(lens), max(lens)
    q, k, v = model_qkv(s, b, t, torch.Generator(device=device).manual_seed(c), device)
    valid = torch.arange(t, device=device)[None] < torch.tensor(lens, device=device)[:, None]
    today: AttentionBackend = (  # what shared/chunk_prefill.py builds per group
        DenseAttention(causal=True)
        if causal
        else DenseAttention(mask=valid[:, None, None, :].expand(-1, 1, t, -1))
    )
    impls: dict[str, AttentionBackend] = {"sdpa": today, "varlen": VarlenAttention(lens, t, causal, device)}
    want, got = (fn(0, q, k, v).float() for fn in impls.values())
    diff = float(((want - got) * valid[:, None, :, None]).abs().max())
    shape = f"C={c} {regime} B={b} T={t}" + (f" short={lens[-1]}" if min(lens) < t else "")
    calls = {name: partial(fn, 0, q, k, v) for name, fn in impls.items()}
    return timed_pair("chunk_prefill", shape, calls, reps, device, {"max_abs_diff": diff})


def chunk_cases(s: Shapes, c: int) -> list[tuple[str, list[int], bool]]:
    t = c + 1
    short = torch.randint(t // 4, t, (s.short,), generator=torch.Generator().manual_seed(c)).tolist()
    return [
        ("piece", [t] * min(max(1, s.piece_tokens // t), s.batch), True),
        ("batch", [t] * s.batch, True),
        ("tail", [t] * (s.batch - s.short) + sorted(short, reverse=True), True),
        ("bidir", [t] * s.top_k, False),
        ("bidir-tail", [t] * (s.top_k - 1) + short[:1], False),
    ]


def retention_case(s: Shapes, c: int, mode: str, both: bool, reps: int, device: torch.device) -> list[dict]:
    static = s.instruction + s.top_k * (c + 1)
    t = static + s.query + (s.gen if mode == "full-mask" else 0)
    q, k, v = model_qkv(s, 1, t, torch.Generator(device=device).manual_seed(c + 1), device)
    query = slice(static, static + s.query)
    masses = {name: torch.zeros(t, dtype=torch.float64, device=device) for name in ("probe", "kernel")}
    impls: dict[str, AttentionBackend] = {
        "probe": RetentionProbe(query, both, 1024, masses["probe"]),  # EngineConfig.retention_block
        "kernel": KernelRetentionProbe(query, both, masses["kernel"]),
    }
    for fn in impls.values():
        fn(0, q, k, v)  # one call each for the comparison (the timing calls only add to the masses)
    want, got = masses["probe"][:static].clone(), masses["kernel"][:static].clone()
    diff = float((want - got).abs().max())
    kept = [
        (keep_top_b(want[a : a + c + 1], s.top_b).tolist(), keep_top_b(got[a : a + c + 1], s.top_b).tolist())
        for a in range(s.instruction, static, c + 1)
    ]
    agree = sum(len(set(x) & set(y)) for x, y in kept) / sum(len(x) for x, _ in kept)
    extra = {"max_abs_diff": diff, "rel_diff": diff / float(want.abs().max()), "top_b_agree": agree}
    shape = f"C={c} {mode} {'bidirectional' if both else 'query-to-chunk'} T={t}"
    calls = {name: partial(fn, 0, q, k, v) for name, fn in impls.items()}
    return timed_pair("retention", shape, calls, reps, device, extra)


def worker_cases(s: Shapes, reps: int, device: torch.device) -> list[Callable[[], list[dict]]]:
    """The whole step 3 of one request per chunk size (the model is built on first use)."""
    built: list = []

    def case(c: int) -> list[dict]:
        if not built:
            built.append(build_model(s.model, device, s.dtype))
        model = built[0]
        ids = torch.randint(
            3, s.model.vocab_size - 8, (s.context,), generator=torch.Generator().manual_seed(c)
        )
        chunks = [[s.model.bos_token_id, *ids[a : a + c].tolist()] for a in range(0, s.context, c)]
        run = {kern: partial(chunk_prefill, model, chunks, "causal", c, s.batch, kernel=kern)
               for kern in ("sdpa", "varlen")}  # fmt: skip
        want, got = (fn()[0] for fn in run.values())
        diff = max(float((want.segment(i) - got.segment(i)).abs().max()) for i in range(len(chunks)))
        shape = f"C={c} context={s.context} chunks={len(chunks)} last={len(chunks[-1])}"
        return timed_pair("worker", shape, run, max(3, reps // 3), device, {"max_abs_diff": diff}, inner=1)

    return [partial(case, c) for c in s.chunk_sizes]


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Chunk-prefill attention and retention: serving path today vs kernel",
        "",
        f"{meta['device']}, {meta['date']}, torch {meta['torch']}, {meta['dtype']}, "
        f"Hq/Hkv/D = {meta['heads']}, {meta.get('wall_s', '?')} s. Command: `{meta['command']}`",
        "",
        "µs per call (eager, median): one layer's attention, or the whole step 3 in `worker` rows; "
        "ratio = latency / today's (the first row of each shape; < 1: the kernel is faster); diff = max abs "
        "difference to today's output (real tokens), chunk KV (worker) or retention scores.",
        "",
        "| kind | shape | impl | latency_us | ratio | max_abs_diff | top_b_agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['shape']} | error | {r['error'][:200]} | | | |")
            continue
        agree = f"{r['top_b_agree']:.4f}" if "top_b_agree" in r else ""
        diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else ""
        lines.append(
            f"| {r['kind']} | {r['shape']} | {r['impl']} | {r['latency_us']:.1f} | {r['ratio']:.2f} "
            f"| {diff} | {agree} |"
        )
    (out / "prefill_kernels.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-worker", action="store_true", help="skip the whole-step-3 rows (no 7B model)")
    a = ap.parse_args(argv)
    if a.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads it when it is first imported (above, via the model code): a fresh process.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), *argv], env=env)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    s = SMOKE if a.smoke else FULL
    reps = 2 if a.smoke else a.reps
    m = s.model
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/prefill_kernels.py", *argv]),
        "torch": torch.__version__, "dtype": str(s.dtype),
        "heads": f"{m.num_heads}/{m.num_kv_heads}/{m.head_dim}",
        "shapes": {k: str(v) for k, v in vars(s).items() if k != "model"},
    }  # fmt: skip
    cases: list[tuple[str, str, Callable[[], list[dict]]]] = [
        ("chunk_prefill", f"C={c} {regime}", partial(chunk_case, s, c, regime, lens, causal, reps, device))
        for c in s.chunk_sizes
        for regime, lens, causal in chunk_cases(s, c)
    ]
    cases += [
        ("retention", f"C={c} {mode} both={both}", partial(retention_case, s, c, mode, both, reps, device))
        for c in s.chunk_sizes
        for mode, both in (("full-mask", True), ("chunk-query", True), ("full-mask", False))
    ]
    if not a.no_worker:
        cases += [("worker", f"C={c}", fn) for c, fn in zip(s.chunk_sizes, worker_cases(s, reps, device))]
    t0, rows = time.perf_counter(), []
    with torch.inference_mode():
        for kind, shape, run in cases:
            try:
                rows += run()
            except Exception as e:  # one shape's failure (an OOM, a backend refusing a layout) is a row
                traceback.print_exc()
                rows.append({"kind": kind, "shape": shape, "error": f"{type(e).__name__}: {e}"})
            meta["wall_s"] = round(time.perf_counter() - t0, 1)
            write(a.out, meta, rows)  # after every case: a partial result survives a timeout
    print((a.out / "prefill_kernels.md").read_text())
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
