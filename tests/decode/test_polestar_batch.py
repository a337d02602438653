"""Polestar-Cache's per-layer work batched across a round's sessions (``policies/polestar_batch.py``,
``polestar_record_group.py``, ``polestar_update_group.py``): its pieces against the single-session ones,
several sessions' tokens and recomputed rows against the oracle's, one call per layer for all sessions.

Planted: a session's proxy built from the next session's centroids (``StackedLayer.proxy`` with
``centroids.roll(1, 0)``) -> the oracle rows tests fail (every knob). Planted: the proxy's padding keys of a
shorter session left unmasked (no ``masked_fill`` of ``~key_valid``) -> the same tests fail.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.polestar_record_group import RecordGroup
from pdllm.decode_service.polestar_rounds import PolestarBatchSession
from pdllm.decode_service.polestar_update_group import UpdateGroup
from pdllm.decode_service.policies import make_policy
from pdllm.decode_service.policies.polestar import layer_proxy
from pdllm.decode_service.policies.polestar_batch import StackedLayer, choose_batched, kmeans_batched
from pdllm.decode_service.policies.polestar_device import choose_clusters
from pdllm.decode_service.policies.polestar_device_store import DeviceClusteredHidden, kmeans_fixed
from pdllm.decode_service.policy_rounds import batch_session, cache_slots
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.rounds import EagerRoundForward, decode_round
from tests.decode.helpers import pool_for, run_rounds
from tests.decode.test_polestar_device import GEN, KNOBS, _policy
from tests.oracles.cases import PROMPT
from tests.oracles.cases import model as oracle_model
from tests.oracles.polestar import polestar_decode

LENGTHS = (16, 11, 7, 13)  # prompts of different lengths: padded rows and clusters


def _session(m: Any, pool: DecodeKVPool, knobs: tuple, prompt: list[int]) -> PolestarBatchSession:
    policy = make_policy(_policy(knobs))
    pages = pool.reserve(cache_slots(len(prompt), GEN, policy))
    assert pages is not None
    s = batch_session(m, StaticDecode(list(prompt), None, GEN, cache_policy=policy), pages, pool.page_size)
    assert isinstance(s, PolestarBatchSession)
    return s


@pytest.mark.parametrize("seed", range(4))
def test_batched_kmeans_equals_each_problems(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sizes, ks = [7, 19, 12, 3], [1, 3, 5, 2]
    xs = [torch.randn(n, 16, generator=gen) for n in sizes]
    x = torch.zeros(len(xs), max(sizes), 16)
    for i, t in enumerate(xs):
        x[i, : len(t)] = t
    valid = torch.arange(max(sizes))[None] < torch.tensor(sizes)[:, None]
    got = kmeans_batched(x, valid, ks, 20)
    for i, (t, k) in enumerate(zip(xs, ks, strict=True)):
        assert torch.equal(got[i, : len(t)], kmeans_fixed(t, k, 20))
        assert (got[i, len(t) :] == max(ks)).all()  # padding rows: the padding cluster


def test_batched_choice_equals_each_sessions() -> None:
    gen = torch.Generator().manual_seed(0)
    kl = torch.randint(0, 4, (3, 6), generator=gen).float() / 4
    kl[1, 4:] = float("-inf")  # a session with 4 clusters: padding
    for top in (1, 2, 6):
        got = choose_batched(kl, top, 0.3)
        assert torch.equal(got[0], choose_clusters(kl[0], top, 0.3))
        assert torch.equal(got[1, :4], choose_clusters(kl[1, :4], top, 0.3)) and not got[1, 4:].any()


def test_stacked_proxy_is_each_sessions_to_rounding() -> None:
    m = oracle_model("dream")
    gen = torch.Generator().manual_seed(1)
    hid, hkv, d = m.config.hidden_size, m.config.num_kv_heads, m.config.head_dim
    shapes = [(23, 9, 13, (2, 3)), (11, 4, 6, (1, 2)), (17, 0, 5, (0, 4))]  # (N, lo, hi, spans)
    stores, keys = [], []
    for big_n, lo, hi, spans in shapes:
        x = torch.randn(big_n, hid, generator=gen)
        stores.append(DeviceClusteredHidden.build(x, (lo, hi), torch.arange(big_n), spans, "int8", 20, 2))
        keys.append(torch.randn(1, hkv, big_n, d, generator=gen))
    stack = StackedLayer.stack(stores, 24)
    k = torch.zeros(3, hkv, 23, d)
    for i, t in enumerate(keys):
        k[i, :, : t.shape[2]] = t[0]
    valid = torch.arange(23)[None] < torch.tensor([s[0] for s in shapes])[:, None]
    got = stack.proxy(m, 1, k, valid)
    for i, (store, t) in enumerate(zip(stores, keys, strict=True)):
        want = layer_proxy(m, 1, store, t)
        # Not bit for bit: the stacked GEMMs and softmax reduce in another order (last-bit differences);
        # what the proxy decides, the chosen rows, is held exact by the oracle tests below.
        torch.testing.assert_close(got[i, :, : store.clusters, : t.shape[2]], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knobs", KNOBS, ids=str)
def test_sessions_tokens_and_rows_equal_the_oracles(knobs: tuple) -> None:
    """Sessions of different lengths join one per round (arrivals mid-block), so rounds mix refreshes,
    updates and cached steps of several sessions; every session's tokens and per-update rows match."""
    m = oracle_model("dream")
    pool = pool_for(m, pages=128)
    sessions = [_session(m, pool, knobs, PROMPT[:n]) for n in LENGTHS]
    seen: dict[int, list[list[list[int]]]] = {id(s): [] for s in sessions}
    sizes: list[int] = []
    finish = UpdateGroup._finish

    def spy(
        self: UpdateGroup, layer: int, sess: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, *a: Any
    ):
        sizes.append(len(self.sessions))
        for i, s in enumerate(self.sessions):
            if layer == 0:
                seen[id(s)].append([])
            seen[id(s)][-1].append(rows[(sess == i) & valid].sort().values.tolist())
        return finish(self, layer, sess, rows, valid, *a)

    clusters, top, t, drift, fmt, recompute = knobs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UpdateGroup, "_finish", spy)
        run_rounds(EagerRoundForward(m, pool, "torch"), list(sessions))
    assert max(sizes) > 1  # sessions did update together
    for s, n in zip(sessions, LENGTHS, strict=True):
        tokens, counters, oracle = polestar_decode(
            m, PROMPT[:n], GEN.gen_length, GEN.block_length, GEN.steps, None, clusters, top, t, drift, fmt,
            recompute=recompute,
        )  # fmt: skip
        assert s.result().raw_tokens == tokens, n
        assert seen[id(s)] == oracle.recomputed, n
        assert s.polestar.rows_recomputed == counters["rows_recomputed"] > 0


@pytest.mark.parametrize("count", [1, 3])
def test_one_call_per_layer_for_all_sessions(count: int) -> None:
    """Sessions that start together refresh and update in the same rounds: each phase's group store (and
    its batched proxy) runs once per layer, whatever the session count."""
    m = oracle_model("llada")
    pool = pool_for(m, pages=96)
    sessions = [_session(m, pool, KNOBS[0], PROMPT[: LENGTHS[i]]) for i in range(count)]
    calls: Counter[tuple[str, int, int]] = Counter()
    rounds = [0]
    originals = {cls: cls.__call__ for cls in (UpdateGroup, RecordGroup)}
    proxy = StackedLayer.proxy

    def counted(cls: type) -> Any:
        def call(self: Any, layer: int, *a: Any) -> None:
            calls[(cls.__name__, rounds[0], layer)] += 1
            assert len(self.sessions) == count
            return originals[cls](self, layer, *a)

        return call

    def counted_proxy(self: StackedLayer, model: Any, layer: int, *a: Any) -> torch.Tensor:
        calls[("proxy", rounds[0], layer)] += 1
        return proxy(self, model, layer, *a)

    forward = EagerRoundForward(m, pool, "torch")
    with pytest.MonkeyPatch.context() as mp:
        for cls in originals:
            mp.setattr(cls, "__call__", counted(cls))
        mp.setattr(StackedLayer, "proxy", counted_proxy)
        while not all(s.done for s in sessions):
            decode_round(forward, [s for s in sessions if not s.done])
            rounds[0] += 1
    layers = len(m.model.layers)
    for kind in ("UpdateGroup", "RecordGroup", "proxy"):
        per_round = Counter(r for (k, r, _), _ in calls.items() if k == kind)
        assert per_round and all(n == layers for n in per_round.values()), kind
    assert set(calls.values()) == {1}  # one call per (kind, round, layer)
    assert all(s.polestar.updates > 0 for s in sessions)
