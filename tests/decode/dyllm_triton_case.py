"""Run under TRITON_INTERPRET=1 (by test_dyllm_rounds.py): DyLLM sessions in rounds through the Triton
kernels (split-S attention and the salient-column update) end with their reference loops' tokens and
counters, a pdllm one over static KV and a vanilla one, beside a plain session; every update is handed the
split-S kernel's row log-sum-exp, equal to the normalizer over the keys ``A_t`` spans."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdllm.decode_service import dyllm_rounds  # noqa: E402
from pdllm.decode_service.request import StaticDecode  # noqa: E402
from pdllm.decode_service.rounds import EagerRoundForward, decode_round  # noqa: E402
from pdllm.decode_service.sessions import rounds_policy  # noqa: E402
from tests.decode.helpers import CASES, POLICY_CASES, alone, pool_for, session  # noqa: E402
from tests.decode.test_dyllm_rounds import (  # noqa: E402
    KNOBS,
    PROMPT,
    VANILLA_GEN,
    _dyllm,
    dyllm_built,
    dyllm_reference,
    dyllm_session,
    spy_on_lse,
)
from tests.model.helpers import tiny_model  # noqa: E402
from tests.reference.vanilla import generate_vanilla  # noqa: E402


def main() -> None:
    given: list[int] = []
    dyllm_rounds.salient_attention = spy_on_lse(dyllm_rounds.salient_attention, given)
    m = tiny_model("dream", seed=0, num_layers=4)
    pool = pool_for(m, pages=128)
    forward = EagerRoundForward(m, pool, "triton")
    want = [dyllm_reference(m, POLICY_CASES[3], 3, KNOBS[1])]
    vanilla = generate_vanilla(m, PROMPT, VANILLA_GEN, policy=_dyllm(KNOBS[0]))
    want.append((vanilla.raw_tokens, dict(vanilla.cache)))
    sessions = [dyllm_session(pool, m, dyllm_built(m, POLICY_CASES[3], 3, KNOBS[1]))]
    built = StaticDecode(list(PROMPT), None, VANILLA_GEN, cache_policy=rounds_policy(_dyllm(KNOBS[0])))
    sessions.append(dyllm_session(pool, m, built))
    plain = session(m, pool, CASES[1], 7)
    active = [*sessions, plain]
    while active:
        decode_round(forward, active)
        active = [s for s in active if not s.done]
    for s, (tokens, cache) in zip(sessions, want, strict=True):
        got = s.result()
        if got.raw_tokens != tokens or got.cache != cache:
            raise SystemExit(f"triton DyLLM rounds {got.raw_tokens} {got.cache} != {tokens} {cache}")
    if len(given) < 4:
        raise SystemExit(f"the salient update ran {len(given)} times")
    if plain.state.tokens.tolist() != alone(m, CASES[1], 7):
        raise SystemExit("triton rounds: the plain session beside DyLLM differs from alone")
    print("ok")


if __name__ == "__main__":
    main()
