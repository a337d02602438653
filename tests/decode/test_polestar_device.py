"""Polestar-Cache's device-side update in the rounds (``policies/polestar_device*.py``): its pieces against the
reference's and no device-to-host read while several sessions' batched update runs (the rows an update
recomputes against the oracle's: ``test_polestar_batch.py``).

Planted: ``choose_clusters`` taking the M smallest drifts -> the choice test fails. Planted: the choice read back with
``.tolist()``, or a boolean-mask gather in ``UpdateGroup`` -> the no-read test fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.polestar_record_group import RecordGroup
from pdllm.decode_service.polestar_rounds import PolestarBatchSession
from pdllm.decode_service.polestar_update_group import UpdateGroup
from pdllm.decode_service.policies import DecodePolicyConfig, make_policy
from pdllm.decode_service.policies.polestar import select_clusters
from pdllm.decode_service.policies.polestar_device import choose_clusters
from pdllm.decode_service.policies.polestar_device_store import DeviceClusteredHidden, kmeans_fixed
from pdllm.decode_service.policies.polestar_store import ClusteredHidden, spherical_kmeans
from pdllm.decode_service.policy_rounds import batch_session, cache_slots
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.rounds import EagerRoundForward, decode_round
from pdllm.shared.generation.sampler import GenerationConfig
from tests.decode.helpers import pool_for
from tests.oracles.cases import PROMPT
from tests.oracles.cases import model as oracle_model

# (clusters, top, T, drift threshold, format, recompute): both recompute modes, every format
KNOBS = [
    (4, 1, 0, 0.0, "int8", "propagated"),
    (6, 2, 1, 1e-4, "fp8", "propagated"),
    (4, 1, 0, 0.0, "int8", "per-layer"),
    (3, 2, 0, 0.0, "none", "per-layer"),
]
GEN = GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False)


def _policy(knobs: tuple) -> DecodePolicyConfig:
    names = (
        "clusters",
        "top_clusters",
        "update_threshold",
        "drift_threshold",
        "residual_format",
        "recompute",
    )
    return DecodePolicyConfig("polestar", polestar={f"polestar_{n}": v for n, v in zip(names, knobs)})


def _vanilla_session(
    m: Any, pool: DecodeKVPool, knobs: tuple, prompt: list[int] = PROMPT
) -> PolestarBatchSession:
    policy = make_policy(_policy(knobs))
    pages = pool.reserve(cache_slots(len(prompt), GEN, policy))
    assert pages is not None
    s = batch_session(m, StaticDecode(list(prompt), None, GEN, cache_policy=policy), pages, pool.page_size)
    assert isinstance(s, PolestarBatchSession)
    return s


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_fixed_round_kmeans_equals_the_converging_one(seed: int, k: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 7 + 5 * seed
    x = torch.randn(n, 16, generator=gen)
    if seed % 2:  # a few tight groups: converges in a few rounds
        x = torch.randn(3, 16, generator=gen)[torch.arange(n) % 3] + 0.05 * x
    for rounds in (1, 2, 20):
        assert torch.equal(kmeans_fixed(x, k, rounds), spherical_kmeans(x, k, rounds))


@pytest.mark.parametrize("seed", range(8))
def test_device_choice_equals_the_host_choice(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kl = torch.randint(0, 4, (7,), generator=gen).float() / 4  # ties
    for top in (1, 2, 7):
        for threshold in (0.0, 0.3, 0.6, 2.0):
            want = torch.zeros(7, dtype=torch.bool)
            want[select_clusters(kl, top, threshold)] = True
            assert torch.equal(choose_clusters(kl, top, threshold), want)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "none"])
def test_device_store_equals_the_reference_store(fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    big_n, lo, hi, hidden = 23, 9, 13, 12
    x = torch.randn(big_n, hidden, generator=gen)
    positions = torch.arange(5, 5 + big_n)
    rows = torch.cat([torch.arange(0, lo), torch.arange(hi, big_n)])
    ref = ClusteredHidden.build(x, rows, positions, lo, (2, 3), fmt, 20)
    dev = DeviceClusteredHidden.build(x, (lo, hi), positions, (2, 3), fmt, 20, top=2)
    new_rows = torch.tensor([1, 14, 20])
    new_x = torch.randn(3, hidden, generator=gen)
    carried = torch.zeros(big_n, dtype=torch.bool).index_fill_(0, new_rows, True)
    dense = torch.zeros(big_n, hidden).index_copy_(0, new_rows, new_x)
    for step in range(2):
        if step:
            ref.update(new_rows, new_x)
            dev.update(carried, dense)
        assert torch.equal(dev.assign, ref.assign) and torch.equal(dev.rows, ref.rows)
        assert torch.equal(dev.centroids, ref.centroids)
        assert torch.equal(dev.centroid_positions, ref.centroid_positions)
        assert dev.codes.dtype == ref.codes.dtype and torch.equal(_bits(dev.codes), _bits(ref.codes))
        assert torch.equal(dev.scales, ref.scales)
        assert torch.equal(dev.hidden(rows), ref.hidden(rows))
    assert dev.num_bytes() == ref.num_bytes()
    sizes = torch.bincount(ref.assign).sort(descending=True).values
    assert int(dev.top_rows) == int(sizes[:2].sum())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


class _Reads(TorchDispatchMode):
    """Ops that read the device from the host, or wait on it to size their output (boolean indexing,
    ``nonzero``, ``unique``...), land in ``seen``; not while ``paused`` (the attention backend's calls)."""

    NAMES = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "unique", "masked_select", "bincount")

    def __init__(self, seen: list[str], paused: list[bool]) -> None:
        super().__init__()
        self.seen, self.paused = seen, paused

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        indices = args[1] if name.startswith("index") and name != "index_copy_" and len(args) > 1 else ()
        bool_index = isinstance(indices, list | tuple) and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices
        )
        read = any(name.lstrip("_").startswith(n.lstrip("_")) for n in self.NAMES)
        if not self.paused[0] and (bool_index or read):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _device_reads(reads: list[str]) -> Iterator[None]:
    """While open, device reads outside the attention backend land in ``reads``: the ops of
    :class:`_Reads` and ``.tolist`` / ``.item`` / ``.cpu`` / ``.numpy`` calls. The attention backend is
    the split-S kernel's stand-in on the CPU (the torch path reads its offsets on the host; the kernel does
    not), so its calls are not counted."""
    paused = [False]
    with pytest.MonkeyPatch.context() as mp:
        for name in ("tolist", "item", "cpu", "numpy"):
            inner = getattr(torch.Tensor, name)

            def spy(t: torch.Tensor, *a: Any, _inner: Any = inner, _name: str = name, **kw: Any) -> Any:
                if not paused[0]:
                    reads.append(_name)
                return _inner(t, *a, **kw)

            mp.setattr(torch.Tensor, name, spy)
        paged = PagedBatchAttention.paged

        def unwatched(self: PagedBatchAttention, *a: Any, **kw: Any) -> torch.Tensor:
            paused[0] = True
            try:
                return paged(self, *a, **kw)
            finally:
                paused[0] = False

        mp.setattr(PagedBatchAttention, "paged", unwatched)
        with _Reads(reads, paused):
            yield


@pytest.mark.parametrize("knobs", [KNOBS[0], KNOBS[2]], ids=str)
def test_an_update_reads_nothing_from_the_device(knobs: tuple) -> None:
    """Three sessions of different lengths, started together: their batched updates read nothing, their
    batched refresh reads once for all of them."""
    m = oracle_model("llada")
    pool = pool_for(m, pages=96)
    sessions = [_vanilla_session(m, pool, knobs, PROMPT[:n]) for n in (16, 9, 12)]
    update_reads: list[str] = []
    refresh_reads: list[list[str]] = []
    update, record = UpdateGroup.__call__, RecordGroup.__call__

    def watched_update(self: UpdateGroup, *args: Any) -> None:
        assert len(self.sessions) == 3
        with _device_reads(update_reads):
            update(self, *args)

    def watched_record(self: RecordGroup, layer: int, *args: Any) -> None:
        assert len(self.sessions) == 3
        if layer == 0:
            refresh_reads.append([])
        with _device_reads(refresh_reads[-1]):
            record(self, layer, *args)

    forward = EagerRoundForward(m, pool, "torch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UpdateGroup, "__call__", watched_update)
        mp.setattr(RecordGroup, "__call__", watched_record)
        while not all(s.done for s in sessions):
            decode_round(forward, [s for s in sessions if not s.done])
    for s in sessions:  # updates ran
        assert s.polestar.updates > 0 and s.polestar.rows_recomputed > 0
    assert update_reads == []
    assert refresh_reads and all(r == ["tolist"] for r in refresh_reads)  # one read per refresh
