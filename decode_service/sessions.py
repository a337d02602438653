"""What a decode request becomes on the scheduler: a session in the batched rounds.

One place decides it for the decode server and the in-process engine alike (no proto here), from the
model family, the method and the decode policy's runtime (:data:`POLICY_RUNTIMES`):

- Dream / LLaDA, any policy but ``focus``: a :class:`~.request.StaticDecode` that joins the rounds (pdllm
  over its static KV; vanilla with its whole prompt as local rows), a policy's cache in pool pages after
  the static KV (:meth:`SessionMaker.pool_slots`; DyLLM: every local row's K/V, ``dyllm_rounds.py``).
  FOCUS measured no gain over plain decoding there: :func:`check_policy_family` refuses it;
- SDAR (block diffusion), any method: exact block diffusion in the rounds (``block_rounds.py``, its cache in
  pool pages; under FOCUS with key regions after it, ``sdar_focus_rounds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.block_diffusion import BlockKVCache
from pdllm.decode_service.block_rounds import block_slots, start_block_decode
from pdllm.decode_service.policies import CachePolicy, DecodePolicyConfig, make_policy
from pdllm.decode_service.policies.focus import ONLY_SDAR
from pdllm.decode_service.policy_rounds import cache_slots
from pdllm.decode_service.request import Started, StaticDecode
from pdllm.decode_service.sdar_focus_rounds import sdar_focus_slots
from pdllm.shared.decode_policy import DyLLMConfig
from pdllm.shared.generation.plain import prompt_tensor
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import Request, decode_layout
from pdllm.shared.model.transformer import DiffusionLM


@dataclass(frozen=True)
class PolicyRuntime:
    """How the decode worker runs a decode policy: ``caches``: it keeps local rows' K/V in pool pages
    (Dream/LLaDA); ``sdar``: it runs on SDAR, in the rounds (FOCUS); ``dream``: it runs on Dream/LLaDA."""

    caches: bool = False
    sdar: bool = False
    dream: bool = True


POLICY_RUNTIMES: dict[str, PolicyRuntime] = {
    "none": PolicyRuntime(),
    "prefix-cache": PolicyRuntime(caches=True),
    "dual-cache": PolicyRuntime(caches=True),
    "sparse-dllm": PolicyRuntime(caches=True),
    "polestar": PolicyRuntime(caches=True),
    "dyllm": PolicyRuntime(caches=True),
    "focus": PolicyRuntime(sdar=True, dream=False),
}


def runtime(policy: DecodePolicyConfig | None) -> PolicyRuntime:
    return POLICY_RUNTIMES["none" if policy is None else policy.name]


def check_policy_family(policy: DecodePolicyConfig | None, model: DiffusionLM) -> None:
    """ValueError for a decode policy the model's family does not run: ``focus`` on Dream/LLaDA
    (:data:`~.policies.focus.ONLY_SDAR`). SDAR's own refusals are ``sdar_decode.check_decode_options``."""
    if policy is not None and not sdar_decode.is_block_diffusion(model) and not runtime(policy).dream:
        raise ValueError(ONLY_SDAR)


def rounds_policy(policy: DecodePolicyConfig | None) -> CachePolicy | DyLLMConfig | None:
    """The policy a Dream/LLaDA request's session in the rounds runs under: a caching one or DyLLM's knobs
    (None: plain steps); ValueError for ``focus`` (SDAR only)."""
    if policy is None:
        return None
    if not runtime(policy).dream:
        raise ValueError(ONLY_SDAR)
    if policy.name == "dyllm":
        return policy.dyllm_config()
    return make_policy(policy)


class SessionMaker:
    """Starts requests for one scheduler. ``page_size``: the scheduler's pool's (SDAR FOCUS's key regions
    are whole pages)."""

    def __init__(self, model: DiffusionLM, page_size: int = 64) -> None:
        self.model, self.page_size = model, page_size

    @property
    def block_diffusion(self) -> bool:
        return sdar_decode.is_block_diffusion(self.model)

    def pool_slots(
        self, policy: DecodePolicyConfig | None, local_rows: int, gen: GenerationConfig, static: bool
    ) -> int:
        """Pool slots a request reserves beyond its static KV: a caching policy's cache (``cache_slots``;
        ``local_rows``: the rows before the response, protected from eviction under pdllm (``static``)). On
        SDAR (``local_rows``: the whole prompt) one per position of prompt and answer, and under FOCUS
        its key regions (``sdar_focus_slots``)."""
        if self.block_diffusion:
            if runtime(policy).sdar:
                model_block = self.model.config.block_size
                assert model_block is not None
                return sdar_focus_slots(block_slots(local_rows, gen), gen, model_block, self.page_size)
            return block_slots(local_rows, gen)
        check_policy_family(policy, self.model)
        if not runtime(policy).caches:
            return 0
        assert policy is not None
        return cache_slots(local_rows, gen, rounds_policy(policy), local_rows if static else 0)

    def vanilla(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        policy: DecodePolicyConfig | None,
    ) -> Started:
        """A vanilla request over ``prompt`` (its BOS included)."""
        model = self.model
        check_policy_family(policy, model)
        tensor = prompt_tensor(model, prompt)
        if self.block_diffusion:  # block diffusion, none or focus (reference: tests/reference/vanilla.py)
            if runtime(policy).sdar:
                assert policy is not None
                return start_block_decode(model, tensor, gen, focus=policy.focus_config())
            sdar_decode.check_decode_options(policy, None, "block diffusion on SDAR models")
            return start_block_decode(model, tensor, gen)
        return StaticDecode(list(prompt), None, gen, cache_policy=rounds_policy(policy))

    def sdar(
        self,
        request: Request,
        gen: GenerationConfig,
        policy: DecodePolicyConfig | None,
        prefix: BlockKVCache | None = None,
    ) -> Started:
        """A pdllm request on SDAR: exact block diffusion over ``[instruction, chunks, query]`` (its chunks:
        the selected ones, in order) continuing its block-causal ``prefix`` (None: built here); under FOCUS
        too."""
        model = self.model
        layout = decode_layout(request, list(range(len(request.chunks))), gen.gen_length)
        sdar_decode.check_decode_options(policy, None)  # before the prefix's forwards
        if prefix is None:
            prefix = sdar_decode.build_prefix(model, request, layout, gen)
        prompt = sdar_decode.selected_prompt_tensor(model, request, layout)
        focus = policy.focus_config() if policy is not None and runtime(policy).sdar else None
        return start_block_decode(model, prompt, gen, prefix, focus)
