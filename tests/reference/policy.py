"""The plain single-request denoising loop under a decode policy (the reference of every cache policy: the
decode worker runs them in the batched rounds, ``decode_service/policy_rounds.py`` and ``polestar_rounds.py``,
held to this loop token for token).

:class:`PolicyLogits` is a :data:`~pdllm.shared.generation.sampler.LogitsFn`: the shared sampler
(:func:`~pdllm.shared.generation.sampler.denoise`) drives it exactly as it drives the plain logits
functions, and stays the one place that decides what to unmask. Per call it asks the policy for a
:class:`StepPlan`, forwards the planned local rows through the model with a
:class:`~pdllm.decode_service.local_cache.LocalCacheAttention` around the method's own backend (vanilla:
dense attention over the local rows; pdllm: the static chunk KV plus the local rows), and returns the
logits of the masked positions.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import torch

from pdllm.decode_service.local_cache import LocalCacheAttention, LocalKVCache
from pdllm.decode_service.policies.base import CachePolicy, CacheStats, StepContext
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult, denoise
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM


def vanilla_local_rows(
    mask_token_id: int, prompt: torch.Tensor, gen: GenerationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """A vanilla request's local rows (prompt + masked response, on the prompt's device) and their
    positions ``[1, N]`` from 0: what every decode loop runs on without static KV."""
    mask = torch.full((gen.gen_length,), mask_token_id, dtype=torch.long, device=prompt.device)
    local = torch.cat([prompt, mask])
    return local, torch.arange(local.shape[0], device=prompt.device)[None]


def check_local_rows(
    local: torch.Tensor, positions: torch.Tensor, response_start: int, gen: GenerationConfig
) -> None:
    """A decode loop's local rows: tokens ``[N]``, positions ``[1, N]``, the response their last
    ``gen_length`` rows after at least one other row (ValueError otherwise)."""
    if local.dim() != 1 or positions.shape != (1, local.shape[0]):
        raise ValueError(f"need local [N] and positions [1, N], got {tuple(local.shape)}, {positions.shape}")
    if not 0 < response_start == local.shape[0] - gen.gen_length:
        raise ValueError("the response must be the last gen_length local rows, after at least one row")


class PolicyLogits:
    """Logits of the masked positions under ``policy``; keeps the local KV cache between calls.

    ``local``: the local rows' tokens ``[N]`` (owned: the response part is overwritten every call);
    ``positions``: their position ids ``[1, N]``; ``response_start``: the local row of response token 0;
    ``inner``: the method's attention backend, called with every local row's K/V (cached or fresh);
    ``protected``: local rows an evicting policy keeps (``StepContext.protected``: pdllm's question).
    """

    def __init__(
        self,
        model: DiffusionLM,
        local: torch.Tensor,
        positions: torch.Tensor,
        response_start: int,
        gen: GenerationConfig,
        policy: CachePolicy,
        inner: AttentionBackend,
        protected: int = 0,
    ) -> None:
        check_local_rows(local, positions, response_start, gen)
        if not 0 <= protected <= response_start:
            raise ValueError(f"protected rows must be within the {response_start} rows before the response")
        self.protected = protected
        self.model, self.local, self.positions = model, local, positions
        self.response_start, self.gen, self.policy, self.inner = response_start, gen, policy, inner
        self.lead = 1 if model.config.shift_logits else 0
        self.cache = LocalKVCache()
        self.stats = CacheStats()
        self._block, self._step_in_block = -1, 0

    def context(self, at: torch.Tensor) -> StepContext:
        """The step's context from the positions the sampler asks for (all in the current block)."""
        # One host read per step: the reference path is plain, not graph-friendly.
        block = int(at.min()) // self.gen.block
        if block != self._block:
            self._block, self._step_in_block = block, 0
        start = self.response_start + block * self.gen.block
        block_tokens = self.local[start : start + self.gen.block]
        unmasked = int((block_tokens != self.model.config.mask_token_id).sum())
        return StepContext(
            step=self.stats.forwards,
            block=block,
            step_in_block=self._step_in_block,
            block_start=start,
            block_end=start + self.gen.block,
            rows=self.local.shape[0],
            lead=self.lead,
            unmasked=unmasked,
            protected=self.protected,
        )

    def __call__(self, response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        self.local[self.response_start :] = response
        ctx = self.context(at)
        plan = self.policy.plan(ctx)
        plan.check(ctx)
        lo, hi = (0, ctx.rows) if plan.refresh else (plan.lo, plan.hi)
        backend: AttentionBackend
        if plan.refresh and not plan.record:  # a plain step: the method's backend, the cache untouched
            backend = self.inner
        else:
            backend = LocalCacheAttention(
                self.inner, self.cache, lo, hi, plan.refresh, plan.visible, plan.keep, plan.rows_hook
            )
        rows_at = (at + (self.response_start - lo))[None]
        attach = getattr(plan.rows_hook, "attach", None)
        with attach(self.model, self.positions) if attach is not None else nullcontext():
            logits = self.model(self.local[None, lo:hi], self.positions[:, lo:hi], backend, logits_at=rows_at)
        logits = logits[0]
        self._step_in_block += 1
        self.stats.forwards += 1
        self.stats.refreshes += int(plan.refresh and plan.record)
        self.stats.rows_forwarded += hi - lo
        self.stats.cache_bytes = max(self.stats.cache_bytes, self.cache.num_bytes())
        # A selective policy keeps its counters in its per-session state (the cache's aux).
        self.stats.updates = sum(int(getattr(a, "updates", 0)) for a in self.cache.aux.values())
        self.stats.rows_recomputed = sum(
            int(getattr(a, "rows_recomputed", 0)) for a in self.cache.aux.values()
        )
        return logits

    def summary(self) -> dict[str, int | str]:
        """The policy's name and counters: ``GenerationResult.cache``, the trace's ``decode_policy``."""
        return {"policy": self.policy.name, **self.stats.as_dict()}


class CountedLogits(Protocol):
    """A decode loop's logits function over its local rows that reports what it saved:
    :class:`PolicyLogits`, DyLLM's (``dyllm.DyLLMBase``)."""

    model: DiffusionLM
    local: torch.Tensor
    gen: GenerationConfig

    def __call__(self, response: torch.Tensor, at: torch.Tensor) -> torch.Tensor: ...

    def summary(self) -> dict[str, int | str]: ...


@torch.inference_mode()
def run_policy(logits_fn: CountedLogits, progress: bool = False) -> GenerationResult:
    """:func:`denoise` driven by ``logits_fn`` to the end; the result's ``cache`` holds its
    ``summary()``."""
    config = logits_fn.model.config
    gen, device = logits_fn.gen, logits_fn.local.device
    result = denoise(gen, config.mask_token_id, config.eos_token_id, logits_fn, device, progress)
    result.cache = logits_fn.summary()
    return result


@torch.inference_mode()
def denoise_with_policy(
    model: DiffusionLM,
    local: torch.Tensor,
    positions: torch.Tensor,
    response_start: int,
    gen: GenerationConfig,
    policy: CachePolicy,
    inner: AttentionBackend,
    progress: bool = False,
) -> GenerationResult:
    """:func:`denoise` with :class:`PolicyLogits`; the result's ``cache`` holds its :class:`CacheStats`."""
    gen.validate()
    return run_policy(PolicyLogits(model, local, positions, response_start, gen, policy, inner), progress)
