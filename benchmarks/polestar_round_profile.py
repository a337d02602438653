"""Where a Polestar-Cache session's batched rounds spend their time.

    python benchmarks/polestar_round_profile.py               # CUDA (results/polestar_round_profile_notes.md)
    python benchmarks/polestar_round_profile.py --batch 16    # 16 sessions in the same rounds
    python benchmarks/polestar_round_profile.py --recompute per-layer  # the knob's other rule
    python benchmarks/polestar_round_profile.py --sync-check  # CUDA: fail on a device sync in an update
    python benchmarks/polestar_round_profile.py --smoke       # CPU: a tiny model, eager rounds

Dream-7B shapes (random bf16), vanilla 1K-token prompt, gen 256, block 32, the paper's knobs, in the decode
worker's rounds (CUDA graphs, split-S). Two blocks, twice (the second is printed: warm). Each round is timed
by kind (refresh / update / cached); the per-layer pieces are timed with a device sync around each, so they
show shares, and add up to more than the rounds. ``--sync-check`` times nothing inside the rounds: it runs
every update store under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.decode_engine import Prompt, sessions  # noqa: E402
from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids  # noqa: E402
from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.decode_service import polestar_record_group, polestar_update_group  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.policies import polestar_batch  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.rounds import EagerRoundForward, decode_round  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
PATCHED: list[tuple[Any, str, Any]] = []  # (owner, name, original): restored when main returns


def timed(owner: Any, name: str, label: str, device: torch.device) -> None:
    """Replace ``owner.name`` by a wrapper that adds its synced seconds to ``label``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync(device)
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sync(device)
        SECONDS[label] += time.perf_counter() - start
        CALLS[label] += 1
        return out

    PATCHED.append((owner, name, inner))
    setattr(owner, name, wrapper)


def sync_checked(owner: Any, name: str) -> None:
    """Replace ``owner.name`` by a wrapper that runs it with CUDA's sync debug mode set to error."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    PATCHED.append((owner, name, inner))
    setattr(owner, name, wrapper)


def instrument(device: torch.device, sync_check: bool) -> None:
    """Time the Polestar group stores (one call per layer for all sessions in a phase) and their pieces."""
    if sync_check:
        sync_checked(polestar_update_group.UpdateGroup, "__call__")
        return
    timed(polestar_record_group.RecordGroup, "__call__", "record store (per layer, all sessions)", device)
    timed(polestar_update_group.UpdateGroup, "__call__", "update store (per layer, all sessions)", device)
    timed(polestar_update_group.UpdateGroup, "_finish", "update o_proj/MLP", device)
    for name in ("stack", "update", "encode", "decode", "proxy"):
        timed(polestar_batch.StackedLayer, name, f"stacked.{name}", device)
    timed(polestar_record_group, "kmeans_batched", "k-means (batched)", device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1, help="sessions decoded together (default 1)")
    ap.add_argument("--sync-check", action="store_true", help="CUDA: error on a device sync in an update")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, a short prompt, eager rounds")
    ap.add_argument("--recompute", choices=["propagated", "per-layer"], default="propagated")
    a = ap.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        print("needs CUDA (or --smoke)")
        return 1
    device = torch.device("cpu" if a.smoke else "cuda")
    mcfg = tiny() if a.smoke else dream7b()
    model = build_model(mcfg, device, torch.float32 if a.smoke else torch.bfloat16)
    if a.smoke:
        pool = DecodeKVPool.for_model(model, KVPoolConfig(1 << 24))
        forward: Any = EagerRoundForward(model, pool, "torch")
        context, gen = 48, GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False)
    else:
        pool = DecodeKVPool.for_model(model, KVPoolConfig(int(torch.cuda.mem_get_info()[0] * 0.4)))
        forward = GraphedRoundForward(model, pool, "triton", capture=True)
        context, gen = 1024, GenerationConfig(gen_length=256, steps=256, block_length=32, stop_at_eos=False)
    rng = torch.Generator().manual_seed(0)
    question = random_ids(QUERY_TOKENS, mcfg.vocab_size, rng)
    prompt = Prompt([mcfg.bos_token_id, *random_ids(context, mcfg.vocab_size, rng), *question], None, 0)
    instrument(device, a.sync_check)
    try:
        profile(model, pool, forward, prompt, gen, a.batch, device, a.recompute)
    finally:
        for owner, name, original in reversed(PATCHED):
            setattr(owner, name, original)
        PATCHED.clear()
    if a.sync_check:
        print("sync check: no device sync in any update store")
    return 0


def profile(
    model: Any,
    pool: DecodeKVPool,
    forward: Any,
    prompt: Prompt,
    gen: GenerationConfig,
    batch: int,
    device: torch.device,
    recompute: str,
) -> None:
    """Two blocks of ``batch`` sessions, twice; prints the second (warm) run's rounds and pieces."""
    assert gen.block_length is not None
    for rep in range(2):
        SECONDS.clear()
        CALLS.clear()
        active = sessions(model, pool, prompt, gen, "polestar", batch)
        for s in active:  # the paper's knobs but the recompute rule
            s.policy = dataclasses.replace(s.policy, recompute=recompute)
        kinds: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(2 * gen.block_length):
            before = [(s.polestar.updates, s.stats.refreshes) for s in active]
            sync(device)
            start = time.perf_counter()
            decode_round(forward, active)
            sync(device)
            refreshed = any(s.stats.refreshes != b[1] for s, b in zip(active, before))
            updated = any(s.polestar.updates != b[0] for s, b in zip(active, before))
            kind = "update" if updated else "refresh" if refreshed else "cached"
            kinds[kind].append(time.perf_counter() - start)
        for s in active:
            pool.release(s.pages)
        if rep == 0:
            continue
        rows = sum(s.polestar.rows_recomputed for s in active)
        print(f"batch {batch}: rows recomputed {rows}, updates {sum(s.polestar.updates for s in active)}")
        for kind, seconds in kinds.items():
            print(f"  {kind} rounds: {len(seconds)}, mean {sum(seconds) / len(seconds) * 1e3:.1f} ms")
        for label in sorted(SECONDS, key=SECONDS.__getitem__, reverse=True):
            print(f"  {label}: {SECONDS[label] * 1e3:.1f} ms over {CALLS[label]} calls")


if __name__ == "__main__":
    sys.exit(main())
