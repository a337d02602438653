"""Per-shape split-S configs: a shape bucket key, a committed table of tuned entries and a heuristic fallback
(:mod:`.split_s_tuner` writes the table), each fitted to the device's shared memory.

:func:`select_config` is what :func:`~pdllm.kernels.split_s_attention.split_s_attention` calls when its
``config`` is None: device name + :class:`ShapeBucket` -> the table's entry if there is one, else
:func:`heuristic_config`; then :func:`fit_config` shrinks it (stages, then tiles) until
:func:`smem_estimate` fits the device's limit, or gives None (the launcher then runs the torch reference).
It reads only host integers (no device sync, so it is safe inside CUDA-graph capture) and is memoised per
raw shape, so a repeat call is one dict lookup.

Bucket key (all "nearest" in log space, ties up, so ``S*C + Lq`` such as 4096 + 96 stays in the 4096 bucket):

- ``rows``: query rows of one (request, KV head) program, ``max_q_len * G``: nearest power of two. It sets
  how many row blocks re-read each KV tile and how much MMA work one KV load feeds.
- ``kv``: keys per request, ``max_kv_len`` (+ ``max_q_len`` with local KV): nearest power of two.
- ``bh``: programs per split, ``B * Hkv``: nearest power of four (B = 1, 4, 16, 64 at Hkv = 4 -> 4 .. 256).
- ``head_dim``, ``page`` (``BLOCK_N <= page`` takes the one-page-per-tile fast path) and ``dtype``.

Table: ``kernels/split_s_tuned.json`` next to this file, or the file named by ``$PDLLM_SPLIT_S_TABLE``
(which then must exist). ``{"version": 1, "entries": [{"device", "bucket": {...}, "config": {...}, "us",
"default_us", "shape"}]}``; a malformed table raises :class:`SplitSTableError` at the first lookup. A config
without ``maxnreg`` has no register cap (registers do not enter the shared-memory fit).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pdllm.kernels.resources import itemsize, smem_limit
from pdllm.kernels.split_s_reference import SplitSConfig

TABLE_ENV = "PDLLM_SPLIT_S_TABLE"
DEFAULT_TABLE = Path(__file__).with_name("split_s_tuned.json")
TABLE_VERSION = 1
# The SplitSConfig fields a table entry may set (num_splits / num_sms belong to a call / a device).
CONFIG_FIELDS = (
    "block_m", "block_n", "num_warps", "num_stages", "min_split_tokens", "programs_per_sm", "partial_cost",
    "fused_merge", "maxnreg", "partials_16bit",
)  # fmt: skip
# Fields written only when not at their default: an entry without one has the default, so older tables load
# (and are written) unchanged.
OPTIONAL_FIELDS = ("maxnreg", "partials_16bit")
ENTRY_FIELDS = {"device", "bucket", "config", "us", "default_us", "shape"}
SMEM_BYTES = 228 * 1024  # Hopper's shared memory per SM, for the heuristic's residency estimate
SCRATCH_BYTES = 4096  # allowance for reductions and layout conversions outside the tiles


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
    """What :func:`select_config` chose, and why (``source`` = "table" or "heuristic").

    ``config`` is what runs: the source's config fitted to ``smem_limit`` (``wanted`` holds the source's
    own when fitting changed it), or None where no config fits (the torch reference runs).
    """

    config: SplitSConfig | None
    source: str
    device: str
    bucket: ShapeBucket
    wanted: SplitSConfig | None = None
    smem_limit: int | None = None


@dataclass(frozen=True)
class TunedTable:
    path: str
    entries: dict[tuple[str, ShapeBucket], SplitSConfig]


def config_to_dict(cfg: SplitSConfig) -> dict:
    """The table's fields of ``cfg``; :data:`OPTIONAL_FIELDS` only where not at their default."""
    default = SplitSConfig()
    return {
        f: getattr(cfg, f)
        for f in CONFIG_FIELDS
        if f not in OPTIONAL_FIELDS or getattr(cfg, f) != getattr(default, f)
    }


_JSON_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "int | None": (int, type(None))}


def config_from_dict(d: object) -> SplitSConfig:
    """A table entry's config; raises ValueError naming an unknown field, a wrong type or a bad value."""
    if not isinstance(d, dict):
        raise ValueError(f"config must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; allowed: {list(CONFIG_FIELDS)}")
    types = {f.name: f.type for f in dataclasses.fields(SplitSConfig)}  # "int", "float", "bool", "int | None"
    for k, v in d.items():
        want = _JSON_TYPES[types[k]]
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

    64x64 tiles, 4 warps, 2 stages: the fastest in every H100 sweep so far (attention_notes.md, rows
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
    # 2 stages of K and V tiles, plus Q
    smem = (2 * 2 * 64 + block_m) * bucket.head_dim * itemsize(getattr(torch, bucket.dtype))
    return SplitSConfig(
        block_m=block_m, num_warps=warps, programs_per_sm=float(max(1, min(4, SMEM_BYTES // smem)))
    )


def smem_estimate(config: SplitSConfig, dtype: torch.dtype, head_dim: int) -> int:
    """Upper estimate of one split-S program's shared memory in bytes.

    The Q tile, ``num_stages`` buffers of the K and V tiles (Triton's pipelining keeps at most that many)
    and the P tile the second dot reads, all in the input dtype; with ``fused_merge`` the merge loop's
    ``num_stages`` fp32 partial tiles where larger (they are live after the main loop, not with it); plus
    :data:`SCRATCH_BYTES`.
    """
    bm, bn, stages = config.block_m, config.block_n, config.num_stages
    tiles = (bm * head_dim + 2 * stages * bn * head_dim + bm * bn) * itemsize(dtype)
    merge = stages * bm * head_dim * 4 if config.fused_merge else 0
    return max(tiles, merge) + SCRATCH_BYTES


def _shrunk(config: SplitSConfig) -> list[SplitSConfig]:
    """``config``, then ever smaller variants: fewer stages (down to 2), then BLOCK_N halved, then BLOCK_M
    halved (each down to 16, at <= 2 stages, warps cut to the row block), then each tile at 1 stage."""
    out = [config]
    out += [dataclasses.replace(config, num_stages=s) for s in range(config.num_stages - 1, 1, -1)]
    stages = min(config.num_stages, 2)
    tiles, bm, bn = [], config.block_m, config.block_n
    while bn > 16:
        bn //= 2
        tiles.append((bm, bn))
    while bm > 16:
        bm //= 2
        tiles.append((bm, bn))

    def tile(bm: int, bn: int, s: int) -> SplitSConfig:
        warps = config.num_warps if bm == config.block_m else min(config.num_warps, 4 if bm >= 64 else 2)
        return dataclasses.replace(config, block_m=bm, block_n=bn, num_stages=s, num_warps=warps)

    out += [tile(bm, bn, stages) for bm, bn in tiles]
    if stages > 1:
        out += [tile(bm, bn, 1) for bm, bn in [(config.block_m, config.block_n), *tiles]]
    return out


def fit_config(config: SplitSConfig, dtype: torch.dtype, head_dim: int, limit: int) -> SplitSConfig | None:
    """``config`` if :func:`smem_estimate` fits ``limit`` bytes, else the first variant of :func:`_shrunk`
    that does (its ``programs_per_sm`` capped by what fits), else None. Pure."""
    for cand in _shrunk(config):
        need = smem_estimate(cand, dtype, head_dim)
        if need <= limit:
            if cand is config:
                return config
            per_sm = float(max(1, min(config.programs_per_sm, limit // need)))
            return dataclasses.replace(cand, programs_per_sm=per_sm)
    return None


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


def _fitted(sel: Selection, dtype: torch.dtype, head_dim: int, limit: int) -> Selection:
    cfg = fit_config(sel.config, dtype, head_dim, limit)
    wanted = None if cfg == sel.config else sel.config
    return dataclasses.replace(sel, config=cfg, wanted=wanted, smem_limit=limit)


@functools.lru_cache(maxsize=4096)
def _select(
    device: str,
    dtype: torch.dtype,
    rows: int,
    kv: int,
    bh: int,
    head_dim: int,
    page: int,
    table_path: str,
    limit: int,
) -> Selection:
    sel = _lookup(_TABLES[table_path], device, ShapeBucket.of(rows, kv, bh, head_dim, page, dtype))
    return _fitted(sel, dtype, head_dim, limit)


def select_config(
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    kv: int,
    batch_heads: int,
    head_dim: int,
    page: int,
    table: TunedTable | None = None,
    smem: int | None = None,
) -> Selection:
    """The table's config for (device name, bucket of this shape), else the heuristic's, fitted to ``smem``
    bytes of shared memory (None: the device's, :func:`~pdllm.kernels.resources.smem_limit`).

    Host integers only (no device sync). ``table`` None = :func:`load_table`'s; memoised per raw shape for
    tables loaded by path (a hand-built ``table`` is looked up afresh each call).
    """
    name = device_name(device)
    limit = smem_limit(device) if smem is None else smem
    if table is None or _TABLES.get(table.path) is table:
        table_path = table.path if table is not None else load_table().path
        return _select(name, dtype, rows, kv, batch_heads, head_dim, page, table_path, limit)
    sel = _lookup(table, name, ShapeBucket.of(rows, kv, batch_heads, head_dim, page, dtype))
    return _fitted(sel, dtype, head_dim, limit)
