"""Run under TRITON_INTERPRET=1 (by test_rounds.py): rounds through the split-S kernel == torch rounds,
with dual-cache and sparse-dllm sessions among them (their cached steps read their cache as paged KV), and
SDAR FOCUS sessions with a plain one (their entries' rows change after layer 1, their key regions paged KV:
an entry per model block of a window, each with its own page table)."""

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
    sdar_focus_rounds()
    print("ok")


def sdar_focus_rounds() -> None:
    """SDAR FOCUS sessions (windows of two and three model blocks, pages of 8: entries with key regions
    of their own, some with no rows) beside a plain SDAR one, equal to their references."""
    import torch

    from tests.decode.test_sdar_focus_rounds import FOCUS, PLAIN, _gen, _session
    from tests.model.helpers import tiny_model
    from tests.oracles.cases import ids
    from tests.reference.block_diffusion import generate_block_diffusion
    from tests.reference.focus import generate_focus_block_diffusion

    m = tiny_model("sdar", seed=1, num_layers=4)
    pool = pool_for(m, pages=256, page_size=8)
    forward = GraphedRoundForward(m, pool, "triton", capture=False)
    specs = [FOCUS[0], FOCUS[1]]
    prompts = [ids(p, 30 + i) for i, (p, *_) in enumerate(specs)]
    focus = [DecodePolicyConfig("focus", focus=k).focus_config() for *_, k in specs]
    want = [
        generate_focus_block_diffusion(m, torch.tensor(p), _gen(*g), f)
        for p, (_, *g, _), f in zip(prompts, specs, focus, strict=True)
    ]
    sessions = [_session(m, pool, p, _gen(*g), k) for p, (_, *g, k) in zip(prompts, specs, strict=True)]
    plain_prompt, (_, *g) = ids(PLAIN[0][0], 60), PLAIN[0]
    plain = _session(m, pool, plain_prompt, _gen(*g), None)
    active = [*sessions, plain]
    while active:
        decode_round(forward, active)
        active = [s for s in active if not s.done]
    for s, ref in zip(sessions, want, strict=True):
        got = s.result()
        if got.raw_tokens != ref.raw_tokens or got.cache != ref.cache:
            raise SystemExit(f"triton SDAR FOCUS rounds {got.raw_tokens} {got.cache} != {ref.raw_tokens}")
    if (
        plain.result().raw_tokens
        != generate_block_diffusion(m, torch.tensor(plain_prompt), _gen(*g)).raw_tokens
    ):
        raise SystemExit("triton rounds: the plain SDAR session beside FOCUS differs from its reference")


if __name__ == "__main__":
    main()
