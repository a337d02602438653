"""Which chunks' step-3 KV the prefill worker writes to the KV tier, once a request's top-K is known.

Scoring reads every chunk's KV, so a request skips chunk prefill only when *all* its chunks hit; a write
pays off only if some later request finds it. ``benchmarks/results/kv_write_policy.md`` measured the three
policies on a repeated-document load (shipped model, 8K-token documents asked several questions each):

- ``all``: every chunk prefill computed. Repeats skip prefill 100% of the time; writes the most (303 MB).
- ``selected``: only the request's top-K chunks (what a chunk-only decode worker reads by key). Repeats
  never skip prefill (0%), since the unselected chunks are always missing; the least written (55 MB).
- ``second-sight`` (the default): the top-K, plus every computed chunk once the request found any of its
  chunks already stored, i.e. its document came back. A document asked once costs only its top-K; from
  its second request on it is whole in the tier (80% of repeats skipped prefill, 119 MB written). The
  rule is stateless: the store itself remembers which documents were seen.

Only chunks computed by this request are candidates: a chunk that hit is in the tier already.
Pure Python (no torch), so ``serve --help`` can list the choices without loading torch.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal, get_args

KVWritePolicy = Literal["all", "selected", "second-sight"]
KV_WRITE_POLICIES: tuple[str, ...] = get_args(KVWritePolicy)
DEFAULT_KV_WRITE_POLICY: KVWritePolicy = "second-sight"


def check_kv_write_policy(policy: str) -> KVWritePolicy:
    """``policy`` when it names one (ValueError naming the accepted ones otherwise)."""
    if policy not in KV_WRITE_POLICIES:
        raise ValueError(f"kv write policy must be one of {', '.join(KV_WRITE_POLICIES)}; got {policy!r}")
    return policy  # type: ignore[return-value]


def chunks_to_write(
    policy: KVWritePolicy, computed: Collection[int], selected: Collection[int], any_hit: bool
) -> list[int]:
    """The chunks (indices in the request) whose KV to write, in order. ``computed``: chunks whose KV this
    request computed (they missed in the tier); ``selected``: its top-K; ``any_hit``: some chunk of the
    request was found in the tier."""
    if policy == "all" or (policy == "second-sight" and any_hit):
        return sorted(set(computed))
    return sorted(set(computed) & set(selected))
