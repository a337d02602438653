"""Run under TRITON_INTERPRET=1 (by test_rounds.py): rounds through the split-S kernel == torch rounds,
with dual-cache and sparse-dllm sessions among them (their cached steps read their cache as paged KV)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.rounds import decode_round  # noqa: E402
from pdllm.shared.decode_policy import DecodePolicyConfig  # noqa: E402
from tests.decode.helpers import CASES, alone, pool_for, session  # noqa: E402
from tests.decode.test_policy_rounds import POLICY_CASES, policy_session, reference  # noqa: E402
from tests.engine.helpers import model  # noqa: E402


def main() -> None:
    m = model("dream")
    cases = [CASES[0], CASES[1], CASES[3]]
    want = [alone(m, case, seed) for seed, case in enumerate(cases)]
    pool = pool_for(m)
    forward = GraphedRoundForward(m, pool, "triton", capture=False)  # padded buckets + the kernel
    sessions = [session(m, pool, case, seed) for seed, case in enumerate(cases)]
    dual = DecodePolicyConfig(name="dual-cache")
    sparse = DecodePolicyConfig(name="sparse-dllm")
    for policy in (dual, sparse):
        sessions.append(policy_session(m, pool, POLICY_CASES[1], 5, policy))
        want.append(reference(m, POLICY_CASES[1], 5, policy)[0])
    active = list(sessions)
    while active:
        decode_round(forward, active)
        active = [s for s in active if not s.done]
    for s, expected in zip(sessions, want, strict=True):
        if s.state.tokens.tolist() != expected:
            raise SystemExit(f"triton rounds {s.state.tokens.tolist()} != alone {expected}")
    print("ok")


if __name__ == "__main__":
    main()
