"""KV tier throughput for one long document's chunk KV: Redis SET/GET, the background writer, the CPU LRU.

    python benchmarks/kv_tier_throughput.py                               # Dream-7B shapes, 32K (~1.9 GB)
    python benchmarks/kv_tier_throughput.py --tokens 4096 --out /tmp/kv   # quick

``--tokens`` context tokens in chunks of ``--chunk`` (C+1 tokens stored each, BOS included), random
``[layers, 2, kv_heads, T, head_dim]`` values (the format stores raw bytes). Through ``pdllm.shared.kv_tier``
on this host: ``RedisStore.put_many`` of the whole document (encode + crc32 + pipelined SET, as a
synchronous write) and ``get_many`` (GET + verify + decode, compared bit for bit) against a redis-server
started here (loopback, no persistence, free port) or ``--redis-url``; ``BackgroundKVWriter`` over Redis
(the caller's ``put_many`` vs. the time until all of it is in Redis), with a queue that holds the document
and with the serving default of 1 GiB; ``CPUStore``. Median of ``--repeats`` after a warm-up. Recompute
cannot be timed on a CPU, so the break-even is stated against ``--prefill-tokens-per-s`` (default: the
measured H100 Dream-7B chunk-prefill rate at 32K, ``benchmarks/results/e2e_speedup.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make tests.fixtures importable
    sys.path.insert(0, str(ROOT))

from pdllm.shared.kv_tier import CPUStore, CPUStoreConfig, KVMeta, RedisStore, RedisStoreConfig  # noqa: E402
from pdllm.shared.kv_tier.format import decode, encode  # noqa: E402
from pdllm.shared.kv_tier.writer import BackgroundKVWriter, KVWriterConfig  # noqa: E402
from tests.fixtures.redis_server import RedisServer  # noqa: E402

NAME = "kv_tier_throughput"
E2E = ROOT / "benchmarks" / "results" / "e2e_speedup.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
Items = list[tuple[str, torch.Tensor]]


def h100_prefill_rate() -> tuple[float, str]:
    """Context tokens per second of step 3 (chunk prefill) at 32K, Dream-7B shapes, H100, from e2e_speedup."""
    row = next(r for r in json.loads(E2E.read_text())["rows"] if r["context_length"] == 32768)
    rate = row["context_length"] / row["phases_s"]["prefill"]
    phases = row["phases_s"]
    return rate, (
        f"e2e_speedup.json, 32768 tokens on an H100, Dream-7B shapes, C=1024: chunk prefill "
        f"{phases['prefill']:.3f} s (+ scoring {phases['score']:.3f} s, which a hit does not save)"
    )


def document(args: argparse.Namespace) -> Items:
    gen = torch.Generator().manual_seed(0)
    items: Items = []
    for i, start in enumerate(range(0, args.tokens, args.chunk)):
        t = min(args.chunk, args.tokens - start) + 1  # + BOS
        shape = (args.layers, 2, args.kv_heads, t, args.head_dim)
        items.append((f"pdkv1:bench:c{args.chunk}:{i:05d}", torch.randn(shape, generator=gen).to(args.dtype)))
    return items


def nbytes(items: Items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """Wall seconds of ``repeats`` runs after one warm-up, and the last result."""
    out, times = fn(), []
    for _ in range(repeats):
        out, start = None, time.perf_counter()  # the previous result is freed before the next run
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def summary(times: list[float], size: int, chunks: int) -> dict[str, float]:
    med, best = statistics.median(times), min(times)
    return {"median_s": med, "best_s": best, "gbps": size / med / 1e9, "gbps_best": size / best / 1e9,
            "per_chunk_ms": med / chunks * 1e3, "times_s": times}  # fmt: skip


def same(items: Items, got: list[torch.Tensor | None]) -> bool:
    return all(g is not None and torch.equal(g.view(torch.uint8), t.view(torch.uint8)) for (_, t), g in zip(items, got))  # fmt: skip


def measure_redis(url: str, meta: KVMeta, items: Items, repeats: int) -> dict[str, Any]:
    size, n = nbytes(items), len(items)
    store = RedisStore(RedisStoreConfig(url, ttl_s=None), meta)
    try:
        set_times, stored = timed(lambda: store.put_many(items), repeats)
        if stored != n:
            raise RuntimeError(f"Redis stored {stored} of {n} chunks: {store.stats()}")
        get_times, got = timed(lambda: store.get_many([k for k, _ in items]), repeats)
        lossless = same(items, got)
        del got
    finally:
        store.close()
    key, tensor = items[0]
    enc_times, value = timed(lambda: encode(tensor, meta, key), repeats)
    dec_times, _ = timed(lambda: decode(value, meta, key), repeats)
    return {"set": summary(set_times, size, n), "get": summary(get_times, size, n), "lossless": lossless,
            "format_encode_ms_per_chunk": statistics.median(enc_times) * 1e3,
            "format_decode_ms_per_chunk": statistics.median(dec_times) * 1e3}  # fmt: skip


def measure_writer(url: str, meta: KVMeta, items: Items, queue_bytes: int, repeats: int) -> dict[str, Any]:
    """Fresh writer per run (empty queue): enqueue on the caller's thread, then drain to Redis."""
    runs = []
    for _ in range(repeats + 1):
        redis = RedisStore(RedisStoreConfig(url, ttl_s=None), meta)
        writer = BackgroundKVWriter(redis, KVWriterConfig(queue_bytes))
        start = time.perf_counter()
        queued = writer.put_many(items)
        enqueue = time.perf_counter() - start
        if not writer.flush(600.0):
            raise RuntimeError("background writer did not drain within 600 s")
        drain = time.perf_counter() - start
        stats = writer.stats()
        writer.close()
        runs.append({"enqueue_s": enqueue, "drain_s": drain, "queued": queued, "stored": stats.puts,
                     "bytes_written": stats.bytes_written})  # fmt: skip
    runs = runs[1:]
    med = {k: statistics.median(r[k] for r in runs) for k in ("enqueue_s", "drain_s", "bytes_written")}
    stored = min(r["stored"] for r in runs)
    return {"queue_bytes": queue_bytes, "enqueue_median_s": med["enqueue_s"], "chunks": len(items),
            "enqueue_ms_per_chunk": med["enqueue_s"] / len(items) * 1e3, "drain_median_s": med["drain_s"],
            "stored_min": stored, "dropped_max": len(items) - stored,
            "drain_gbps": med["bytes_written"] / med["drain_s"] / 1e9, "runs": runs}  # fmt: skip


def measure_cpu(items: Items, repeats: int) -> dict[str, Any]:
    size, n = nbytes(items), len(items)
    store = CPUStore(CPUStoreConfig(capacity_bytes=2 * size + (1 << 20), pin_memory=False))
    put_times, _ = timed(lambda: store.put_many(items), repeats)
    get_times, got = timed(lambda: store.get_many([k for k, _ in items]), repeats)
    lossless = same(items, got)
    store.close()
    return {"put": summary(put_times, size, n), "get": summary(get_times, size, n), "lossless": lossless}


def break_even(args: argparse.Namespace, size: int, get_s: float) -> dict[str, Any]:
    recompute = args.tokens / args.prefill_tokens_per_s
    return {
        "prefill_tokens_per_s": args.prefill_tokens_per_s, "prefill_source": args.prefill_source,
        "recompute_s": recompute, "redis_get_s": get_s, "get_over_recompute": get_s / recompute,
        "break_even_get_gbps": size / args.tokens * args.prefill_tokens_per_s / 1e9,  # GET must beat this
        "tier_pays_below_prefill_tokens_per_s": args.tokens / get_s,  # prefill slower than this: read it back
    }  # fmt: skip


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown")


def markdown(d: dict[str, Any]) -> str:
    m, s, r, b, c = d["meta"], d["shape"], d["redis"], d["break_even"], d["cpu"]
    lines = [
        f"# KV tier throughput, one {s['tokens']}-token document — {m['device']}, {m['date']}", "",
        f"`{m['command']}`", "",
        f"CPU measurement ({m['cpu_count']} cores, load average {m['load_before'][0]:.1f} before / "
        f"{m['load_after'][0]:.1f} after; redis-server {m['redis_version']} on loopback, no persistence). "
        f"Shapes: {s['layers']} layers x 2 x {s['kv_heads']} KV heads x {s['head_dim']}, {s['dtype']}: "
        f"{s['bytes_per_token']} B/token; {s['chunks']} chunks of up to {s['chunk'] + 1} tokens "
        f"({s['chunk_bytes'] / 2**20:.1f} MiB each), {s['doc_bytes'] / 1e9:.2f} GB in all. Median of "
        f"{m['repeats']} runs after a warm-up; GB/s = payload bytes / time.", "",
        "| path | whole document s | GB/s | per chunk ms | best s | lossless |", "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for label, x, ok in [
        ("Redis SET (`RedisStore.put_many`)", r["set"], r["lossless"]),
        ("Redis GET (`RedisStore.get_many`)", r["get"], r["lossless"]),
        ("CPU LRU put (`CPUStore.put_many`, one copy)", c["put"], c["lossless"]),
        ("CPU LRU get (`CPUStore.get_many`, no copy)", c["get"], c["lossless"]),
    ]:
        rate = "—" if "no copy" in label else f"{x['gbps']:.2f}"  # hands out references: no bytes move
        lines.append(f"| {label} | {x['median_s']:.3f} | {rate} | {x['per_chunk_ms']:.2f} | {x['best_s']:.3f} "
                     f"| {'yes' if ok else 'NO'} |")  # fmt: skip
    lines += [
        "", f"Format alone, per chunk: encode (copy + crc32) {r['format_encode_ms_per_chunk']:.1f} ms, decode "
        f"(crc32 + view) {r['format_decode_ms_per_chunk']:.1f} ms. Redis used_memory after the writes: "
        f"{d['redis_used_memory'] / 1e9:.2f} GB.", "",
        "Background writer over Redis (fresh writer per run, the whole document handed over in one `put_many`, "
        "as chunk prefill does):", "",
        "| queue bytes | caller's put_many ms (per chunk) | until in Redis s | chunks stored / dropped | drain GB/s |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for w in d["writer"]:
        lines.append(
            f"| {w['queue_bytes'] / 2**30:.2f} GiB | {w['enqueue_median_s'] * 1e3:.0f} "
            f"({w['enqueue_ms_per_chunk']:.1f}) | {w['drain_median_s']:.2f} | {w['stored_min']} / "
            f"{w['dropped_max']} | {w['drain_gbps']:.2f} |"
        )
    lines += [
        "", f"Break-even against recompute at {b['prefill_tokens_per_s']:.0f} tokens/s ({b['prefill_source']}): "
        f"recomputing the document takes {b['recompute_s']:.2f} s, reading it from Redis {b['redis_get_s']:.2f} s "
        f"({b['get_over_recompute']:.2f}x the recompute). GET pays off above {b['break_even_get_gbps']:.2f} GB/s "
        "at that rate; at the GET rate measured here the tier pays off wherever prefill runs slower than "
        f"{b['tier_pays_below_prefill_tokens_per_s']:.0f} tokens/s (on a GPU host a host-to-device copy comes "
        "on top).",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default="", help="use this Redis (default: start one on a free port)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--tokens", type=int, default=32768, help="context tokens of the document")
    ap.add_argument("--chunk", type=int, default=1024, help="chunk size (each chunk stores C+1 tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-write-queue-bytes", type=int, default=1 << 30, help="the serving default")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=None, help="default: H100 Dream-7B")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--prefill-source", default="given with --prefill-tokens-per-s", help="where it comes from"
    )
    ap.add_argument("--name", default=NAME, help="output file stem")
    args = ap.parse_args(argv)
    args.dtype = DTYPES[args.dtype]
    if args.prefill_tokens_per_s is None:
        args.prefill_tokens_per_s, args.prefill_source = h100_prefill_rate()
    return args


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    import redis as redis_py

    meta = KVMeta("bench", args.dtype, args.layers, args.kv_heads, args.head_dim)
    items = document(args)
    size = nbytes(items)
    client = redis_py.Redis.from_url(url)
    red = measure_redis(url, meta, items, args.repeats)
    used_memory = int(client.info("memory")["used_memory"])
    client.flushdb()
    writer = []
    for queue in (2 * size, args.kv_write_queue_bytes):  # one that holds the document, the default
        writer.append(measure_writer(url, meta, items, queue, args.repeats))
        print(json.dumps({k: v for k, v in writer[-1].items() if k != "runs"}), flush=True)
        client.flushdb()
    version = client.info("server")["redis_version"]
    client.close()
    cpu = measure_cpu(items, args.repeats)
    shape = {
        "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": str(args.dtype),
        "tokens": args.tokens, "chunk": args.chunk, "chunks": len(items), "doc_bytes": size,
        "chunk_bytes": nbytes(items[:1]), "bytes_per_token": args.layers * 2 * args.kv_heads * args.head_dim
        * args.dtype.itemsize,
    }  # fmt: skip
    return {"shape": shape, "redis": red, "redis_used_memory": used_memory, "redis_version": version,
            "writer": writer, "cpu": cpu, "break_even": break_even(args, size, red["get"]["median_s"])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    if args.redis_url:
        data = run(args, args.redis_url)
    else:
        with RedisServer() as server:
            data = run(args, server.url)
    data["meta"] = {
        "device": f"cpu: {cpu_name()}", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/kv_tier_throughput.py", *(argv or sys.argv[1:])]),
        "redis_version": data.pop("redis_version"), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "load_before": load_before,
        "load_after": os.getloadavg(), "runtime_s": time.perf_counter() - started,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=1) + "\n")
    text = markdown(data)
    (args.out / f"{args.name}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
