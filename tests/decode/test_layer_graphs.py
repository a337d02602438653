"""The eager rounds' layers around the attention (``layer_graphs.LayerGraphs``), run on their buffers off
CUDA: Sparse-dLLM sessions (a per-layer store, so the round runs eagerly) equal their reference loop through
the layer buffers and through every layer's own forward (rounds above ``max_rows``).

Planted by hand: the ``max_rows`` bound ignored -> the ``max_rows`` 0 case fails; the cos table not copied
into the bucket -> the other case's tokens differ.
"""

from __future__ import annotations

import pytest

from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.round_graphs import GraphedRoundForward
from tests.decode.helpers import POLICY_CASES, policy_session, pool_for, reference, run_rounds
from tests.engine.helpers import model


@pytest.mark.parametrize("max_rows", [4096, 0])
def test_sparse_dllm_rounds_through_the_layer_buffers_or_each_layer_equal_the_reference(
    max_rows: int,
) -> None:
    m = model("dream")
    policy = DecodePolicyConfig(name="sparse-dllm")
    want = [reference(m, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    pool = pool_for(m, pages=128)
    forward = GraphedRoundForward(m, pool, "torch", capture=False)
    layers = forward.eager.layer_graphs
    assert layers is not None
    layers.max_rows = max_rows
    sessions = [policy_session(m, pool, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    run_rounds(forward, sessions)
    for s, (tokens, cache), case in zip(sessions, want, POLICY_CASES, strict=True):
        result = s.result()
        assert result.raw_tokens == tokens, case
        assert result.cache == cache, case
    # every eager round went through the buckets, or (max_rows 0) none did
    assert bool(layers._buckets) == (max_rows > 0)
