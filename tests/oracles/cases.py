"""Inputs the oracle tests share: tiny random models, a vanilla prompt, a pdllm request, and the runtime entry
points they drive (``generate_vanilla``, ``PrefillingEngine.generate``). Runtime code is called here only as
the thing under test; the oracles themselves (the other modules of this package) never import it."""

from __future__ import annotations

import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM
from tests.model.helpers import tiny_model
from tests.reference.vanilla import generate_vanilla

from .prefilling import PdllmCase, pdllm_case

PROMPT = [1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3, 58, 12, 44, 19]
CHUNK = 12
TOP_K = 2
INSTRUCTION = [5, 7, 9]


def model(family: str, layers: int = 3, seed: int = 0) -> DiffusionLM:
    return tiny_model(family, seed=seed, num_layers=layers)


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=gen).tolist()  # clear of pad/bos/eos and [MASK]


CONTEXT, QUESTION = ids(50, 1), ids(6, 2)


def gen(gen_length: int, steps: int, block: int, threshold: float | None) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen_length, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False
    )


def vanilla(m: DiffusionLM, g: GenerationConfig, policy: DecodePolicyConfig) -> GenerationResult:
    return generate_vanilla(m, PROMPT, g, policy=policy)


def pdllm(
    m: DiffusionLM, g: GenerationConfig, policy: DecodePolicyConfig
) -> tuple[GenerationResult, list[int]]:
    """The in-process engine's answer (pseudo-label scoring, full-mask KV, one SDPA over static + local K/V)
    and the chunks it selected."""
    engine = PrefillingEngine(m, None, EngineConfig(chunk_size=CHUNK, top_k=TOP_K), decode_attention="torch")
    result, trace = engine.generate(CONTEXT, QUESTION, g, INSTRUCTION, decode_policy=policy)
    return result, trace.selected


def pdllm_oracle_case(m: DiffusionLM, g: GenerationConfig) -> PdllmCase:
    """The same request's selection and static KV, from the oracle (pseudo-labels: 4 tokens, 2 rounds)."""
    return pdllm_case(m, CONTEXT, QUESTION, INSTRUCTION, CHUNK, TOP_K, g.gen_length)


def counters(result: GenerationResult, expected: dict[str, int]) -> dict[str, int | str]:
    """The runtime's counters named in ``expected`` (a missing one shows as absent)."""
    return {k: result.cache.get(k, "absent") for k in expected}


def case_id(values: tuple) -> str:
    """A parameter tuple as a test id without spaces: ``(16, 16, 8, None)`` -> ``16-16-8-None``."""
    return "-".join(map(str, values))
