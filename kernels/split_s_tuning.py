"""Per-shape split-S configs: a shape bucket key, a committed table of tuned entries, a heuristic fallback,
and the CUDA tuner that writes the table.

:func:`select_config` is what :func:`~pdllm.kernels.split_s_attention.split_s_attention` calls when its
``config`` is None: device name + :class:`ShapeBucket` -> the table's entry if there is one, else
:func:`heuristic_config`. It reads only host integers (no device sync, so it is safe inside CUDA-graph
capture) and is memoised per raw shape, so a repeat call is one dict lookup.

Bucket key (all "nearest" in log space, ties up, so ``S*C + Lq`` such as 4096 + 96 stays in the 4096 bucket):

- ``rows``: query rows of one (request, KV head) program, ``max_q_len * G``: nearest power of two. It sets
  how many row blocks re-read each KV tile and how much MMA work one KV load feeds.
- ``kv``: keys per request, ``max_kv_len`` (+ ``max_q_len`` with local KV): nearest power of two.
- ``bh``: programs per split, ``B * Hkv``: nearest power of four (B = 1, 4, 16, 64 at Hkv = 4 -> 4 .. 256).
- ``head_dim``, ``page`` (``BLOCK_N <= page`` takes the one-page-per-tile fast path) and ``dtype``.

Table: ``kernels/split_s_tuned.json`` next to this file, or the file named by ``$PDLLM_SPLIT_S_TABLE``
(which then must exist). ``{"version": 1, "entries": [{"device", "bucket": {...}, "config": {...}, "us",
"default_us", "shape"}]}``; a malformed table raises :class:`SplitSTableError` at the first lookup.

Tuning (CUDA only; times every :func:`candidates` config with CUDA-graph replay, keeps the default unless a
candidate is >= 3% faster, merges the winners into ``--out``, replacing this device's entries it re-tuned)::

    python -m pdllm.kernels.split_s_tuning --out kernels/split_s_tuned.json [--budget-s 420]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdllm.kernels.split_s_reference import SplitSConfig

TABLE_ENV = "PDLLM_SPLIT_S_TABLE"
DEFAULT_TABLE = Path(__file__).with_name("split_s_tuned.json")
TABLE_VERSION = 1
# The SplitSConfig fields a table entry may set (num_splits / num_sms belong to a call / a device).
CONFIG_FIELDS = (
    "block_m", "block_n", "num_warps", "num_stages", "min_split_tokens", "programs_per_sm", "partial_cost",
    "fused_merge",
)  # fmt: skip
ENTRY_FIELDS = {"device", "bucket", "config", "us", "default_us", "shape"}
SMEM_BYTES = 228 * 1024  # Hopper's shared memory per SM, for the heuristic's residency estimate
Call = Callable[[], list[torch.Tensor]]


class SplitSTableError(ValueError):
    """The tuned-config table cannot be used (unreadable, wrong version, bad entry); says which and where."""


def _nearest_pow(x: int, log_step: int) -> int:
    """Nearest power of ``2**log_step`` to ``x`` in log space (ties up); 1 for ``x <= 1``."""
    if x <= 1:
        return 1
    return 1 << (log_step * math.floor(math.log2(x) / log_step + 0.5))


@dataclass(frozen=True)
class ShapeBucket:
    rows: int
    kv: int
    bh: int
    head_dim: int
    page: int
    dtype: str

    @classmethod
    def of(
        cls, rows: int, kv: int, batch_heads: int, head_dim: int, page: int, dtype: torch.dtype | str
    ) -> ShapeBucket:
        """Bucket of one call: raw per-request maxima and counts in, bucket values out."""
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        return cls(
            _nearest_pow(rows, 1), _nearest_pow(kv, 1), _nearest_pow(batch_heads, 2), head_dim, page, name
        )

    def check(self) -> None:
        """Raise ValueError unless every field is a value :meth:`of` can produce."""
        for name, step in (("rows", 1), ("kv", 1), ("bh", 2)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or _nearest_pow(v, step) != v:
                raise ValueError(f"{name}={v!r} is not a bucket value (a power of {2**step})")
        for name in ("head_dim", "page"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v!r} must be a power of two")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={self.dtype!r} must be bfloat16, float16 or float32")


@dataclass(frozen=True)
class Selection:
    """What :func:`select_config` chose, and why (``source`` = "table" or "heuristic")."""

    config: SplitSConfig
    source: str
    device: str
    bucket: ShapeBucket


@dataclass(frozen=True)
class TunedTable:
    path: str
    entries: dict[tuple[str, ShapeBucket], SplitSConfig]


def config_to_dict(cfg: SplitSConfig) -> dict:
    return {f: getattr(cfg, f) for f in CONFIG_FIELDS}


def config_from_dict(d: object) -> SplitSConfig:
    """A table entry's config; raises ValueError naming an unknown field, a wrong type or a bad value."""
    if not isinstance(d, dict):
        raise ValueError(f"config must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; allowed: {list(CONFIG_FIELDS)}")
    types = {f.name: f.type for f in dataclasses.fields(SplitSConfig)}  # "int", "float", "bool"
    for k, v in d.items():
        want = {"bool": (bool,), "int": (int,), "float": (int, float)}[types[k]]
        if not isinstance(v, want) or (isinstance(v, bool) and bool not in want):
            raise ValueError(f"config field {k}={v!r} must be {types[k]}")
    return SplitSConfig(**d)


def _parse_entry(e: object) -> tuple[tuple[str, ShapeBucket], SplitSConfig]:
    keys = set(e) if isinstance(e, dict) else set()
    if not {"device", "bucket", "config"} <= keys <= ENTRY_FIELDS:
        raise ValueError(f"need an object with device, bucket, config (and only {sorted(ENTRY_FIELDS)})")
    if not isinstance(e["device"], str) or not e["device"] or not isinstance(e["bucket"], dict):
        raise ValueError("device must be a non-empty string and bucket an object")
    bucket = ShapeBucket(**e["bucket"])
    bucket.check()
    return (e["device"], bucket), config_from_dict(e["config"])


def parse_table(raw: object, path: str) -> TunedTable:
    """Validate a decoded table; every problem is a :class:`SplitSTableError` naming the file and entry."""
    ok = (
        isinstance(raw, dict) and raw.get("version") == TABLE_VERSION and isinstance(raw.get("entries"), list)
    )
    if not ok:
        raise SplitSTableError(f"{path}: need an object with version {TABLE_VERSION} and an 'entries' list")
    entries: dict[tuple[str, ShapeBucket], SplitSConfig] = {}
    for i, e in enumerate(raw["entries"]):
        try:
            key, cfg = _parse_entry(e)
        except (TypeError, ValueError) as err:
            raise SplitSTableError(f"{path}: entry {i}: {err}") from None
        if key in entries:
            raise SplitSTableError(f"{path}: entry {i} repeats device {key[0]!r} bucket {key[1]}")
        entries[key] = cfg
    return TunedTable(path, entries)


# Parsed tables by path: a table file is read once per process (clear_caches() re-reads).
_TABLES: dict[str, TunedTable] = {}


def load_table(path: str | Path | None = None) -> TunedTable:
    """The table at ``path``, else at ``$PDLLM_SPLIT_S_TABLE``, else the committed one (empty if absent)."""
    env = os.environ.get(TABLE_ENV) if path is None else None
    explicit = path is not None or env is not None
    key = str(path) if path is not None else env or str(DEFAULT_TABLE)
    table = _TABLES.get(key)
    if table is None:
        p = Path(key)
        if not p.exists() and not explicit:
            table = TunedTable(key, {})  # e.g. a wheel built without the JSON: heuristic everywhere
        else:
            try:
                raw = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise SplitSTableError(f"{key}: cannot read the split-S config table: {err}") from None
            table = parse_table(raw, key)
        _TABLES[key] = table
    return table


def clear_caches() -> None:
    _TABLES.clear()
    _select.cache_clear()
    _device_name.cache_clear()


def heuristic_config(bucket: ShapeBucket) -> SplitSConfig:
    """The config for a bucket with no table entry.

    64x64 tiles, 4 warps, 2 stages: the fastest in every H100 sweep so far (attention_v1/v2_sweep.json, rows
    224..1792, KV 4K..33K). 128-row blocks with 8 warps, the obvious guess for large ``Lq*G``, were 9-30%
    slower in all 5 shapes of the v2 sweep, so they are left to the tuner. Row blocks shrink to 32 / 16
    (2 warps) when ``rows`` is that small, where a 64-row tile would mostly multiply padding (unmeasured: no
    such serving shape yet). BLOCK_N stays 64 at every page size: at page 16 it takes the multi-page gather
    path, whose rows are still contiguous D-vectors, rather than 16-wide tiles (BLOCK_N = 32 was slower in
    9 of 10 sweep points). ``programs_per_sm`` (the split planner's residency) is estimated from the tile's
    shared memory; for bf16 at d = 128 the result is exactly the fixed default ``SplitSConfig()``.
    """
    block_m = 16 if bucket.rows <= 16 else 32 if bucket.rows <= 32 else 64
    warps = 4 if block_m == 64 else 2
    itemsize = torch.empty((), dtype=getattr(torch, bucket.dtype)).element_size()
    smem = (2 * 2 * 64 + block_m) * bucket.head_dim * itemsize  # 2 stages of K and V tiles, plus Q
    return SplitSConfig(
        block_m=block_m, num_warps=warps, programs_per_sm=float(max(1, min(4, SMEM_BYTES // smem)))
    )


@functools.cache
def _device_name(kind: str, index: int) -> str:
    return torch.cuda.get_device_name(index) if kind == "cuda" else kind


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices (cached; no sync), the device type otherwise."""
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    return _device_name(device.type, index if index is not None else 0)


def _lookup(table: TunedTable, device: str, bucket: ShapeBucket) -> Selection:
    cfg = table.entries.get((device, bucket))
    if cfg is not None:
        return Selection(cfg, "table", device, bucket)
    return Selection(heuristic_config(bucket), "heuristic", device, bucket)


@functools.lru_cache(maxsize=4096)
def _select(
    device: str, dtype: torch.dtype, rows: int, kv: int, bh: int, head_dim: int, page: int, table_path: str
) -> Selection:
    return _lookup(_TABLES[table_path], device, ShapeBucket.of(rows, kv, bh, head_dim, page, dtype))


def select_config(
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    kv: int,
    batch_heads: int,
    head_dim: int,
    page: int,
    table: TunedTable | None = None,
) -> Selection:
    """The table's config for (device name, bucket of this shape), else the heuristic's.

    Host integers only (no device sync). ``table`` None = :func:`load_table`'s; memoised per raw shape for
    tables loaded by path (a hand-built ``table`` is looked up afresh each call).
    """
    name = device_name(device)
    if table is None or _TABLES.get(table.path) is table:
        table_path = table.path if table is not None else load_table().path
        return _select(name, dtype, rows, kv, batch_heads, head_dim, page, table_path)
    return _lookup(table, name, ShapeBucket.of(rows, kv, batch_heads, head_dim, page, dtype))


# ---------------------------------------------------------------------------------------------------------
# Tuner (CUDA only)


def candidates(bucket: ShapeBucket) -> list[SplitSConfig]:
    """The configs the tuner times for ``bucket``, the fixed default first (the one to beat by 3%).

    tests/kernels/interpreter_cases.py runs every (block_m, block_n, fused_merge) of these at pages 16 and 64.
    """
    out = [
        SplitSConfig(),
        SplitSConfig(num_stages=3),
        SplitSConfig(block_n=32),
        SplitSConfig(block_n=128),  # > page 64: the gather path, half the loop trips
        SplitSConfig(block_m=128),  # one warpgroup on 128 rows: half the KV re-reads of 64-row blocks
        SplitSConfig(block_m=128, num_warps=8, programs_per_sm=1.0),
        SplitSConfig(block_m=128, num_warps=8, num_stages=3, programs_per_sm=1.0),
        SplitSConfig(block_m=128, block_n=128, num_warps=8, programs_per_sm=1.0),
        SplitSConfig(block_m=128, block_n=32, num_stages=3),
        SplitSConfig(programs_per_sm=1.0, min_split_tokens=256),  # fewer, longer splits
        SplitSConfig(programs_per_sm=3.0, min_split_tokens=64),  # more, shorter splits
        SplitSConfig(fused_merge=True),
    ]
    if bucket.rows <= 32:
        out += [SplitSConfig(block_m=m, num_warps=2, programs_per_sm=4.0) for m in (16, 32)]
    if bucket.page < 64:
        out.append(SplitSConfig(block_n=max(16, bucket.page)))  # the one-page-per-tile fast path
    return out


def call_cost(
    batch: int, lq: int, hq: int, hkv: int, d: int, kv_tokens: int, itemsize: int
) -> tuple[float, float]:
    """(FLOPs, bytes) of one call: the issue's ``4 * B * Lq * Hq * d * kv_tokens`` (local keys left out) and
    the K+V bytes read (paged ``kv_tokens`` plus the ``Lq`` local tokens per request)."""
    return 4.0 * batch * lq * hq * d * kv_tokens, 2.0 * batch * (kv_tokens + lq) * hkv * d * itemsize


def predicted_ms(flops: float, nbytes: float) -> float:
    """A call's time at a nominal 400 TFLOP/s (a Triton attention loop's) or 3 TB/s: for skip rules only."""
    return max(flops / 400e9, nbytes / 3e9)


@dataclass(frozen=True)
class TuneShape:
    batch: int
    lq: int
    kv_tokens: int
    page: int
    hq: int = 28
    hkv: int = 4
    head_dim: int = 128


def _runner(
    shape: TuneShape, dtype: torch.dtype, replicas: int, dev: torch.device
) -> Callable[[SplitSConfig], Call]:
    """``make(cfg)`` -> a function running ``replicas`` calls, each over its own scattered KV copy."""
    from pdllm.kernels.split_s_attention import split_s_attention

    s = shape
    g = torch.Generator(device=dev).manual_seed(0)
    pages = s.batch * -(-s.kv_tokens // s.page)
    q = torch.randn(s.batch * s.lq, s.hq, s.head_dim, device=dev, dtype=dtype, generator=g)
    kv_lens = torch.full((s.batch,), s.kv_tokens, dtype=torch.int32, device=dev)
    offsets = torch.arange(0, s.batch * s.lq + 1, s.lq, dtype=torch.int32, device=dev)
    data = []
    for _ in range(replicas):
        pool = torch.randn(2, pages, s.hkv, s.page, s.head_dim, device=dev, dtype=dtype, generator=g)
        table = torch.randperm(pages, device=dev, generator=g).to(torch.int32).view(s.batch, -1)
        local = torch.randn(2, s.batch * s.lq, s.hkv, s.head_dim, device=dev, dtype=dtype, generator=g)
        data.append((pool, table, local))

    def make(cfg: SplitSConfig) -> Call:
        return lambda: [
            split_s_attention(q, p[0], p[1], t, kv_lens, offsets, loc[0], loc[1], config=cfg,
                              max_q_len=s.lq, max_kv_len=s.kv_tokens)
            for p, t, loc in data
        ]  # fmt: skip

    return make


def graph_time_us(fn: Call, target_s: float = 0.15, max_reps: int = 20) -> float:
    """Median microseconds of one ``fn()`` replayed from a CUDA graph (as the decode step runs it)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm the allocator off the capture stream, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times: list[float] = []
    reps = max_reps
    while len(times) < reps:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
        reps = max(3, min(max_reps, int(target_s * 1e6 / max(times[0], 1.0))))
    return sorted(times)[len(times) // 2]


def tune_bucket(
    shape: TuneShape, bucket: ShapeBucket, dtype: torch.dtype, dev: torch.device | None = None
) -> dict:
    """Time every candidate on ``shape``; returns the table entry (plus ``timings`` for the details file)."""
    dev = dev if dev is not None else torch.device("cuda", torch.cuda.current_device())
    _, nbytes = call_cost(shape.batch, shape.lq, shape.hq, shape.hkv, shape.head_dim, shape.kv_tokens, 2)
    # >= 200 MB per replay, so the KV comes from HBM, not L2 (one copy off CUDA: the interpreter check).
    replicas = max(1, min(16, math.ceil(200e6 / nbytes))) if dev.type == "cuda" else 1
    make = _runner(shape, dtype, replicas, dev)
    want = make(SplitSConfig())()[0].float()
    timings: list[tuple[SplitSConfig, float, str]] = []
    for cfg in candidates(bucket):
        try:
            fn = make(cfg)
            err = float((fn()[0].float() - want).norm() / want.norm())
            if not err < 2e-2:  # a wrong answer (or NaN) can never win
                raise RuntimeError(f"rel. error {err:.2e} vs the default config")
            timings.append((cfg, graph_time_us(fn) / replicas, ""))
        except Exception as e:  # out of shared memory, compile failure: recorded, not fatal
            timings.append((cfg, math.inf, f"{type(e).__name__}: {str(e)[:160]}"))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    default_us = timings[0][1]
    if not math.isfinite(default_us):
        raise RuntimeError(f"the default config failed on {shape}: {timings[0][2]}")
    best_cfg, best_us, _ = min(timings, key=lambda t: t[1])
    if not best_us < 0.97 * default_us:  # not a clear win: keep the default (sweeps are +-2% noisy)
        best_cfg, best_us = timings[0][0], default_us
    return {
        "device": device_name(dev),
        "bucket": dataclasses.asdict(bucket),
        "config": config_to_dict(best_cfg),
        "us": round(best_us, 2),
        "default_us": round(default_us, 2),
        "shape": dataclasses.asdict(shape),
        "timings": [
            [config_to_dict(c), round(us, 2) if math.isfinite(us) else None, e] for c, us, e in timings
        ],
    }


def write_table(path: Path, new: list[dict]) -> None:
    """Merge ``new`` entries into the table at ``path`` (same device + bucket replaced), sorted, validated."""
    old = json.loads(path.read_text()) if path.exists() else {"version": TABLE_VERSION, "entries": []}
    parse_table(old, str(path))  # refuse to merge into (and so overwrite) a malformed table
    fresh = [{k: v for k, v in e.items() if k in ENTRY_FIELDS} for e in new]
    keys = {(e["device"], json.dumps(e["bucket"], sort_keys=True)) for e in fresh}
    kept = [e for e in old["entries"] if (e["device"], json.dumps(e["bucket"], sort_keys=True)) not in keys]
    entries = sorted(kept + fresh, key=lambda e: (e["device"], sorted(e["bucket"].items())))
    out = {"version": TABLE_VERSION, "about": old.get("about", __doc__.splitlines()[0]), "entries": entries}
    parse_table(out, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import time

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    ap = argparse.ArgumentParser(description="Tune split-S configs per shape bucket (CUDA only).")
    ap.add_argument("--out", type=Path, default=DEFAULT_TABLE)
    ap.add_argument("--details", type=Path, default=None, help="also write every candidate's timing here")
    ap.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--lqs", type=ints, default=[32, 96])
    ap.add_argument("--kv", type=ints, default=[1024, 4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--pages", type=ints, default=[64])
    ap.add_argument("--hq", type=int, default=28)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--max-call-ms", type=float, default=12.0, help="skip shapes predicted slower than this")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new buckets after this")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the tuner times kernels on a CUDA device; none is available")
    t0, dtype = time.monotonic(), torch.bfloat16
    todo: dict[ShapeBucket, TuneShape] = {}
    for page in a.pages:
        for b in a.batches:
            for lq in a.lqs:
                for kv in a.kv:
                    shape = TuneShape(b, lq, kv, page, a.hq, a.hkv, a.head_dim)
                    if predicted_ms(*call_cost(b, lq, a.hq, a.hkv, a.head_dim, kv, 2)) > a.max_call_ms:
                        print(f"skip {shape}: predicted > {a.max_call_ms} ms per call", flush=True)
                        continue
                    bucket = ShapeBucket.of(lq * (a.hq // a.hkv), kv + lq, b * a.hkv, a.head_dim, page, dtype)
                    todo.setdefault(bucket, shape)
    done: list[dict] = []
    # Cheapest first, so a budget cut drops the largest shapes.
    for bucket, shape in sorted(todo.items(), key=lambda it: it[1].batch * it[1].lq * it[1].kv_tokens):
        if time.monotonic() - t0 > a.budget_s:
            print(f"budget spent: {bucket} left to the heuristic", flush=True)
            continue
        try:
            entry = tune_bucket(shape, bucket, dtype)
        except Exception as e:  # e.g. out of memory: this bucket stays with the heuristic
            print(f"{bucket}: not tuned ({type(e).__name__}: {str(e)[:200]})", flush=True)
            continue
        done.append(entry)
        print(f"{bucket}: {entry['config']} {entry['us']} us (default {entry['default_us']} us)", flush=True)
        write_table(a.out, done)  # after every bucket: a run cut short still leaves a valid table
        if a.details is not None:
            a.details.write_text(json.dumps(done, indent=1) + "\n")
    print(f"{len(done)} of {len(todo)} buckets tuned in {time.monotonic() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
