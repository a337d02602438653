"""Where a Polestar-Cache session's batched rounds spend their time (CUDA only).

    python benchmarks/polestar_round_profile.py      # findings: results/polestar_rounds_notes.md

Dream-7B shapes (random bf16), vanilla 1K-token prompt, gen 256, block 32, batch 1, the paper's knobs, in
the decode worker's rounds (CUDA graphs, split-S). Two blocks, twice (the second is printed: warm). Each
round is timed by kind (refresh / update / cached); the per-layer pieces are timed with a device sync
around each, so they show shares, and add up to more than the rounds.
"""

from __future__ import annotations

import collections
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
from benchmarks.shapes import build_model, dream7b  # noqa: E402
from pdllm.decode_service import polestar_rounds  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.policies import polestar, polestar_store  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.rounds import decode_round  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its synced seconds to ``label``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        torch.cuda.synchronize()
        SECONDS[label] += time.perf_counter() - start
        CALLS[label] += 1
        return out

    setattr(owner, name, wrapper)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    device = torch.device("cuda")
    mcfg = dream7b()
    model = build_model(mcfg, device, torch.bfloat16)
    pool = DecodeKVPool.for_model(model, KVPoolConfig(int(torch.cuda.mem_get_info()[0] * 0.4)))
    forward = GraphedRoundForward(model, pool, "triton", capture=True)
    rng = torch.Generator().manual_seed(0)
    question = random_ids(QUERY_TOKENS, mcfg.vocab_size, rng)
    prompt = Prompt([mcfg.bos_token_id, *random_ids(1024, mcfg.vocab_size, rng), *question], None, 0)
    gen = GenerationConfig(gen_length=256, steps=256, block_length=32, stop_at_eos=False)
    timed(polestar_rounds.PolestarRecord, "__call__", "record store (per layer)")
    timed(polestar_rounds.PolestarUpdate, "__call__", "update store (per layer)")
    for name in ("record", "drifting", "finish"):
        timed(polestar.PolestarState, name, f"state.{name}")
    for name in ("update", "_fetch", "_encode"):
        timed(polestar_store.ClusteredHidden, name, f"store.{name}")
    timed(polestar_store, "spherical_kmeans", "k-means")
    timed(polestar, "layer_proxy", "drift proxy")
    for rep in range(2):
        SECONDS.clear()
        CALLS.clear()
        (s,) = sessions(model, pool, prompt, gen, "polestar", 1)
        kinds: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(2 * gen.block):
            before = (s.polestar.updates, s.stats.refreshes)
            torch.cuda.synchronize()
            start = time.perf_counter()
            decode_round(forward, [s])
            torch.cuda.synchronize()
            kind = "refresh" if s.stats.refreshes != before[1] else "cached"
            kind = "update" if s.polestar.updates != before[0] else kind
            kinds[kind].append(time.perf_counter() - start)
        pool.release(s.pages)
        if rep == 0:
            continue
        print(f"rows recomputed {s.polestar.rows_recomputed}, updates {s.polestar.updates}")
        for kind, seconds in kinds.items():
            print(f"  {kind} rounds: {len(seconds)}, mean {sum(seconds) / len(seconds) * 1e3:.1f} ms")
        for label in sorted(SECONDS, key=SECONDS.__getitem__, reverse=True):
            print(f"  {label}: {SECONDS[label] * 1e3:.1f} ms over {CALLS[label]} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
