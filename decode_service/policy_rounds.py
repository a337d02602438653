"""Decode policies in the batched rounds: Fast-dLLM's prefix and dual cache, one forward for many requests.

A :class:`PolicyBatchSession` is a :class:`~.rounds.BatchSession` whose steps follow a decode policy
(``shared/generation/policies``; its eager reference loop, ``PolicyLogits``, is the specification). Its
local rows' K/V cache lives in the KV pool, in pages reserved after its static KV: the session's logical
slots are ``[static KV][cached local rows]``, so the split-S kernel reads the cache like any paged KV and
the round needs no other attention call.

- A **refresh** step (a block's first step, or every ``refresh_steps``) forwards every local row over the
  static KV, like a plain session, and stores the fresh K/V of the rows the block's cached steps will read
  into the cache slots: rows ``[0, lo)`` then ``[hi, N)``, where ``[lo, hi)`` is what those steps forward
  (dual cache: the block, plus the row before it on Dream; prefix cache: the block and everything after it).
- A **cached** step forwards rows ``[lo, hi)`` only; their queries read the static KV plus the ``N - (hi -
  lo)`` cached slots (``kv_len``) and their own fresh K/V (the kernel's local part).

That is the reference's ``[cache[:lo], fresh[lo:hi], cache[hi:]]`` with the same K/V, in another order
(attention is bidirectional: the order of keys does not matter). Sessions of any policy, and plain ones,
share one round: rows are packed ragged, so a 33-row cached step costs 33 rows of the GEMMs, not a padded
full step. Policies whose plans go beyond row ranges (``keep``, ``visible``, ``rows_hook``, ``record=False``:
Sparse-dLLM, Polestar-Cache) are not batched yet; the worker steps them alone through the reference loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdllm.decode_service.jobs import StaticDecode
from pdllm.decode_service.rounds import BatchSession, RoundRows
from pdllm.shared.generation.device_state import DeviceDenoiseState
from pdllm.shared.generation.policies import CachePolicy, CacheStats, DualCache, StepContext, StepPlan
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM

BATCHED_POLICIES = ("prefix-cache", "dual-cache")


def cache_slots(query_tokens: int, gen: GenerationConfig) -> int:
    """Pool slots a policy session reserves for its cache, beyond its static KV: one per local row."""
    return query_tokens + gen.gen_length


@dataclass
class PolicyBatchSession(BatchSession):
    """A batched session under a row-range decode policy (:data:`BATCHED_POLICIES`); ``pages`` hold its
    static KV, then room for :func:`cache_slots` cached rows (``page_size`` slots per page). Made by
    :meth:`start_policy`."""

    policy: CachePolicy = DualCache()
    page_size: int = 64
    lead: int = 0  # rows before the block whose hidden states its logits need (1: shifted logits)
    row_bytes: int = 0  # K/V bytes of one local row, all layers
    cached_rows: int = 0  # valid cache slots (after the static KV)
    stats: CacheStats = field(default_factory=CacheStats)

    @classmethod
    def start_policy(
        cls,
        model: DiffusionLM,
        query: list[int],
        query_start: int,
        kv_tokens: int,
        pages: list[int],
        gen: GenerationConfig,
        policy: CachePolicy,
        page_size: int,
        device_sampler: bool = True,
    ) -> PolicyBatchSession:
        if policy.name not in BATCHED_POLICIES:
            raise ValueError(f"decode policy {policy.name!r} is not batched; batched: {BATCHED_POLICIES}")
        need = -(-(kv_tokens + cache_slots(len(query), gen)) // page_size)
        if len(pages) < need:
            raise ValueError(
                f"a {policy.name} session needs {need} pages (static KV + cache), got {len(pages)}"
            )
        base = BatchSession.start(model, query, query_start, kv_tokens, pages, gen, device_sampler)
        c = model.config
        elem = next(model.parameters()).element_size()
        return cls(
            base.query,
            base.query_start,
            base.kv_tokens,
            base.pages,
            base.state,
            policy=policy,
            page_size=page_size,
            lead=1 if c.shift_logits else 0,
            row_bytes=c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem,
        )

    def context(self) -> StepContext:
        """The next step's place, from the state's host mirror (no device read)."""
        state = self.state
        block = state.config.block
        on_device = isinstance(state, DeviceDenoiseState)
        masked = state.masked if on_device else int(state.positions().numel())  # type: ignore[union-attr]
        start = len(self.query) + state.block * block
        return StepContext(
            step=state.steps_taken,
            block=state.block,
            step_in_block=state.step_in_block,
            block_start=start,
            block_end=start + block,
            rows=len(self.query) + state.config.gen_length,
            lead=self.lead,
            unmasked=block - masked,
        )

    def _plan(self, ctx: StepContext) -> StepPlan:
        plan = self.policy.plan(ctx)
        plan.check(ctx)
        if not plan.record or plan.keep is not None or plan.visible is not None or plan.rows_hook is not None:
            raise ValueError(f"decode policy {self.policy.name!r} planned a step the rounds cannot batch")
        return plan

    def _slot(self, j: int) -> tuple[int, int]:
        """(page, slot in page) of cache slot ``j``."""
        at = self.kv_tokens + j
        return self.pages[at // self.page_size], at % self.page_size

    def round_rows(self) -> RoundRows:
        """The next step's rows; a refresh also stores the rows the block's cached steps will read."""
        ctx = self.context()
        plan = self._plan(ctx)
        self.stats.forwards += 1
        if not plan.refresh:
            self.stats.rows_forwarded += plan.hi - plan.lo
            return RoundRows(plan.lo, plan.hi, self.kv_tokens + self.cached_rows)
        self.stats.refreshes += 1
        self.stats.rows_forwarded += ctx.rows
        # The block's later steps: same range, whatever step of the block they are (``refresh_due``).
        later = self._plan(replace(ctx, step_in_block=ctx.step_in_block + 1))
        kept = [] if later.refresh else [*range(later.lo), *range(later.hi, ctx.rows)]
        self.cached_rows = len(kept)
        # The pool slots reserved for the cache (one per local row), like the reference's full cache.
        self.stats.cache_bytes = ctx.rows * self.row_bytes
        writes = tuple((row, *self._slot(j)) for j, row in enumerate(kept))
        return RoundRows(0, ctx.rows, self.kv_tokens, writes)

    def result(self) -> GenerationResult:
        result = super().result()
        result.cache = {"policy": self.policy.name, **self.stats.as_dict()}
        return result


def batch_session(
    model: DiffusionLM,
    built: StaticDecode,
    query_start: int,
    kv_tokens: int,
    pages: list[int],
    page_size: int,
) -> BatchSession:
    """A built request's session in the rounds: under its batched decode policy, if it has one."""
    if built.cache_policy is None:
        return BatchSession.start(model, built.query, query_start, kv_tokens, pages, built.gen)
    return PolicyBatchSession.start_policy(
        model, built.query, query_start, kv_tokens, pages, built.gen, built.cache_policy, page_size
    )
