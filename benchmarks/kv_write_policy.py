"""Which chunk KV should prefill write to the KV tier? Hit rates and bytes on a repeated-document load.

    python benchmarks/kv_write_policy.py                                # shipped model, CPU, ~1 minute
    python benchmarks/kv_write_policy.py --tokens 2048 --out /tmp/kvp   # quick

``--repeated`` ``multidoc`` documents (``shared/eval/tasks.py``) asked ``--questions`` different questions
each ("In which city was <entity> founded?", entities drawn from the document), ``--once`` documents asked
one. Each request runs the real ``PrefillingEngine.prefill`` (shipped model and settings: chunk lookup,
prefill of the misses, scoring, top-K, then the writes) with the engine's ``kv_write_policy`` set to each
policy of ``shared/kv_write_policy.py`` in turn: ``all`` (every prefilled chunk), ``selected`` (only the
request's top-K), or ``second-sight`` (the serving default: ``selected``, plus every missed chunk when the
request found any of its chunks stored, i.e. its document came back: stateless, the store remembers), over
an unbounded store that counts what is written. Scoring needs every chunk's KV, so a request skips
prefill only if all its chunks hit. Reported: per-chunk hit rate, requests that skip prefill, chunks
forwarded, KV bytes written, and the decode worker's chunk-only lookups (the selected chunks' keys).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.eval.tasks import make_sample
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_tier import CPUStore, CPUStoreConfig
from pdllm.shared.kv_write_policy import KV_WRITE_POLICIES
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt

ENTITY = re.compile(r"Document \[\d+\]: (.+?) was founded in the city of")


class CountingStore(CPUStore):
    """The engine's chunk store (an unbounded CPU LRU) that counts the values and bytes written to it."""

    def __init__(self) -> None:
        super().__init__(CPUStoreConfig(1 << 40, pin_memory=False))
        self.values = self.bytes = 0

    def put_many(self, items: Any) -> int:
        self.values += len(items)
        self.bytes += sum(t.numel() * t.element_size() for _, t in items)
        return super().put_many(items)


def workload(args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    requests = []
    for d in range(args.repeated + args.once):
        sample = make_sample("multidoc", args.tokens, rng.random(), args.seed + d, tokenizer)
        entities = ENTITY.findall(sample.context)
        asks = rng.sample(entities, args.questions if d < args.repeated else 1)
        for q in asks:
            question = f"In which city was {q} founded?"
            tokens = len(encode_prompt(tokenizer, sample.context, question).context)
            requests.append(
                {"doc": d, "context": sample.context, "question": question, "context_tokens": tokens}
            )
    return requests


def run_policy(policy: str, loaded: Any, cfg: EngineConfig, requests: list[dict[str, Any]]) -> dict[str, Any]:
    store = CountingStore()
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, cfg, store=store, kv_write_policy=policy)
    gen = GenerationConfig(gen_length=16, steps=16)
    rows, seen_docs = [], set()
    for r in requests:
        ids = encode_prompt(loaded.tokenizer, r["context"], r["question"])
        start = time.perf_counter()
        sel = engine.prefill(ids.context, ids.query, gen)
        decode_hits = sum(v is not None for v in store.get_many([sel.keys[i] for i in sel.selected]))
        t = sel.trace
        rows.append({"doc": r["doc"], "repeat": r["doc"] in seen_docs, "chunks": t.num_chunks,
                     "context_tokens": r["context_tokens"], "hits": t.cache_hits, "skipped": t.prefill_skipped,
                     "selected": sel.selected, "decode_lookups": len(sel.selected), "decode_hits": decode_hits,
                     "prefill_s": t.timings["prefill"], "request_s": time.perf_counter() - start})  # fmt: skip
        seen_docs.add(r["doc"])
    later = [x for x in rows if x["repeat"]]
    total = lambda key, xs: sum(x[key] for x in xs)  # noqa: E731
    cold = [x for x in rows if x["hits"] == 0]
    return {
        "policy": policy, "requests": len(rows), "later_requests": len(later),
        "chunk_hit_rate_later": total("hits", later) / max(1, total("chunks", later)),
        "chunk_hit_rate_all": total("hits", rows) / total("chunks", rows),
        "skip_rate_later": sum(x["skipped"] for x in later) / max(1, len(later)),
        "chunks_forwarded": total("chunks", rows) - total("hits", rows),
        "later_prefill_s_mean": total("prefill_s", later) / max(1, len(later)),
        "values_written": store.values, "bytes_written": store.bytes,
        "decode_hit_rate": total("decode_hits", rows) / total("decode_lookups", rows),
        "cold_prefill_tokens_per_s": statistics.median(x["context_tokens"] / x["prefill_s"] for x in cold),
        "rows": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="context tokens per document")
    ap.add_argument("--repeated", type=int, default=3, help="documents asked several questions")
    ap.add_argument("--questions", type=int, default=6, help="questions per repeated document")
    ap.add_argument("--once", type=int, default=6, help="documents asked one question")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    loaded = load_model(None)
    cfg = EngineConfig.from_settings(loaded.serving.engine)
    requests = workload(args, loaded.tokenizer)
    run_policy("all", loaded, cfg, requests[:1])  # warm-up
    results = [run_policy(policy, loaded, cfg, requests) for policy in KV_WRITE_POLICIES]
    meta = {
        "device": f"cpu: {cpu_name()}", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/kv_write_policy.py", *(argv or sys.argv[1:])]),
        "model": os.path.relpath(loaded.path, Path(__file__).resolve().parents[1]),
        "engine": {"chunk_size": cfg.chunk_size, "top_k": cfg.top_k, "chunk_boundary": cfg.chunk_boundary},
        "workload": vars(args) | {"out": str(args.out)},
        "torch_threads": torch.get_num_threads(), "load_average_after": os.getloadavg(),
        "same_selections": len({str([x["selected"] for x in r["rows"]]) for r in results}) == 1,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_write_policy.json").write_text(json.dumps({"meta": meta, "policies": results}, indent=1))
    (args.out / "kv_write_policy.md").write_text(markdown(meta, results))
    print(markdown(meta, results))
    return 0


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown")


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    w, e = meta["workload"], meta["engine"]
    lines = [
        f"# KV write policy on a repeated-document workload — {meta['device']}, {meta['date']}", "",
        f"`{meta['command']}`", "",
        f"Shipped model ({meta['model']}), C={e['chunk_size']}, top-K={e['top_k']}, {e['chunk_boundary']} "
        f"boundaries; multidoc contexts of {w['tokens']} tokens: {w['repeated']} documents x {w['questions']} "
        f"different questions + {w['once']} documents x 1 question, unbounded store; one warm-up request first. "
        f"Prefill times are CPU times on a shared 2-core host (load average after: "
        f"{meta['load_average_after'][0]:.1f}): noisy. \"Later\" = requests on a "
        "document seen before; skip = all chunks hit, no chunk prefill at all. Top-K selections identical "
        f"under every policy: {'yes' if meta['same_selections'] else 'NO'}.", "",
        "| policy | chunk hit rate (later requests) | prefill skipped (later requests) | chunks forwarded "
        "| chunk prefill s per later request (mean) | values written | KV MB written | decode chunk-only lookups hit "
        "| cold prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results:
        lines.append(
            f"| {r['policy']} | {r['chunk_hit_rate_later']:.1%} | {r['skip_rate_later']:.1%} "
            f"| {r['chunks_forwarded']} | {r['later_prefill_s_mean']:.2f} | {r['values_written']} | {r['bytes_written'] / 1e6:.1f} "
            f"| {r['decode_hit_rate']:.1%} | {r['cold_prefill_tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
