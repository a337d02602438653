"""Decode policies in the batched rounds: Fast-dLLM's prefix and dual cache and Sparse-dLLM, one forward for
many requests.

A :class:`PolicyBatchSession` is a :class:`~.rounds.BatchSession` whose steps follow a decode policy
(``decode_service/policies``; its eager reference loop, ``tests/reference/policy.py``, is the specification).
Its local rows' K/V cache lives in the KV pool, in pages reserved after its static KV: the session's logical
slots are ``[static KV][cached local rows]``, so the split-S kernel reads the cache like any paged KV and the
round needs no other attention call.

- A **refresh** step (a block's first step, or every ``refresh_steps``) forwards every local row over the
  static KV, like a plain session, and stores the fresh K/V of the rows the block's cached steps will read
  into the cache slots: rows ``[0, lo)`` then ``[hi, N)``, where ``[lo, hi)`` is what those steps forward
  (dual cache: the block, plus the row before it on Dream; prefix cache: the block and everything after it).
- A **cached** step forwards rows ``[lo, hi)`` only; their queries read the static KV plus the ``N - (hi -
  lo)`` cached slots (``kv_len``) and their own fresh K/V (the kernel's local part).

That is the reference's ``[cache[:lo], fresh[lo:hi], cache[hi:]]`` with the same K/V, in another order
(attention is bidirectional: the order of keys does not matter). Sessions of any policy, and plain ones,
share one round: rows are packed ragged, so a 33-row cached step costs 33 rows of the GEMMs, not a padded
full step.

**Sparse-dLLM** (``SparseDLLM``'s plans): its delayed steps (``record=False``) are plain full steps; its
caching step is a refresh whose stores are chosen on the device inside the forward (:class:`SalientStore`:
per layer, the selection from that layer's queries and keys, a fixed ``p + floor((N - b - p) r)`` rows
compacted into the cache slots, ``p`` the question's protected rows: ``sparse_dllm.kept_count``), so a round holding one runs eagerly, not as a graph (once per block and session);
its cached steps replay like the dual cache's. On Dream the row before the block may be kept at some
layer and is also forwarded fresh by the cached steps: it is stored in the last slot and, at that layer,
not read there (``drop``: per-layer cached slot counts, subtracted from ``kv_len``), as the reference's
fresh rows replace cached ones. Polestar-Cache's sessions (``polestar_rounds.py``) build on these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from pdllm.decode_service.device_state import DeviceDenoiseState
from pdllm.decode_service.policies import CachePolicy, CacheStats, DualCache, StepContext, StepPlan
from pdllm.decode_service.policies.sparse_dllm import SaliencyKeep, SparseDLLM, kept_count
from pdllm.decode_service.request import BlockDecode, Started
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import RoundRows
from pdllm.decode_service.rounds import BatchSession, CachingSession
from pdllm.shared.decode_policy import DyLLMConfig
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


def cache_slots(
    query_tokens: int,
    gen: GenerationConfig,
    policy: CachePolicy | DyLLMConfig | None = None,
    protected: int = 0,
) -> int:
    """Pool slots a policy session reserves for its cache, beyond its static KV: one per local row, except
    under Sparse-dLLM, whose cache holds only the rows it keeps (:func:`kept_count`, ``protected``: the
    question's rows, always kept)."""
    rows = query_tokens + gen.gen_length  # DyLLM too: every local row's K/V
    if isinstance(policy, SparseDLLM):
        return kept_count(rows, SaliencyKeep(0, gen.block, policy.retention, policy.pool_kernel, protected))
    return rows


@dataclass
class PolicyBatchSession(CachingSession):
    """A batched session under a row-range decode policy (:attr:`runs`); ``pages`` hold its
    static KV, then room for :func:`cache_slots` cached rows (``page_size`` slots per page). Made by
    :meth:`start_policy`."""

    runs: ClassVar[tuple[str, ...]] = ("prefix-cache", "dual-cache", "sparse-dllm")
    policy: CachePolicy = DualCache()
    lead: int = 0  # rows before the block whose hidden states its logits need (1: shifted logits)
    row_bytes: int = 0  # K/V bytes of one local row, all layers
    cached_rows: int = 0  # valid cache slots (after the static KV)
    stats: CacheStats = field(default_factory=CacheStats)
    row_layers: int = 0
    device: torch.device = torch.device("cpu")  # the model's (and the pool's)
    # [layers] int32 on the device: Sparse-dLLM kept the row before the block at that layer (Dream), which
    # the cached steps forward fresh: it sits in the last cache slot, and those steps do not read it there.
    drop: torch.Tensor | None = None

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
        if policy.name not in cls.runs:
            raise ValueError(f"{cls.__name__} does not run decode policy {policy.name!r}, only {cls.runs}")
        protected = len(query) if kv_tokens else 0  # as ``context()``: vanilla protects no row
        need = -(-(kv_tokens + cache_slots(len(query), gen, policy, protected)) // page_size)
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
            row_layers=c.num_layers,
            device=next(model.parameters()).device,
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
            rows=self.local_rows,
            lead=self.lead,
            unmasked=block - masked,
            # pdllm's question (``StepContext.protected``); a session without static KV (vanilla: its query
            # is the whole prompt) has none, as the reference vanilla loop.
            protected=len(self.query) if self.kv_tokens else 0,
        )

    def _plan(self, ctx: StepContext) -> StepPlan:
        return self._batchable(self.policy.plan(ctx), ctx)

    def _batchable(self, plan: StepPlan, ctx: StepContext) -> StepPlan:
        plan.check(ctx)
        selective = plan.keep is not None and not isinstance(plan.keep, SaliencyKeep)
        if selective or plan.visible is not None or plan.rows_hook is not None:
            raise ValueError(f"decode policy {self.policy.name!r} planned a step the rounds cannot batch")
        return plan

    def round_rows(self) -> RoundRows:
        """The next step's rows; a refresh also stores the rows the block's cached steps will read."""
        ctx = self.context()
        return self._rows(ctx, self._plan(ctx))

    def _rows(self, ctx: StepContext, plan: StepPlan) -> RoundRows:
        self.stats.forwards += 1
        if not plan.refresh:
            self.stats.rows_forwarded += plan.hi - plan.lo
            return RoundRows(plan.lo, plan.hi, self.kv_tokens + self.cached_rows, drop=self.drop)
        self.stats.rows_forwarded += ctx.rows
        if not plan.record:  # a plain full step (Sparse-dLLM before its delayed caching step)
            return RoundRows(0, ctx.rows, self.kv_tokens)
        self.stats.refreshes += 1
        if isinstance(plan.keep, SaliencyKeep):
            return self._record_salient(ctx, plan.keep)
        self.drop = None
        # The block's later steps: same range, whatever step of the block they are (``refresh_due``).
        later = self._plan(replace(ctx, step_in_block=ctx.step_in_block + 1))
        kept = [] if later.refresh else [*range(later.lo), *range(later.hi, ctx.rows)]
        self.cached_rows = len(kept)
        # The pool slots reserved for the cache (one per local row), like the reference's full cache.
        self.stats.cache_bytes = ctx.rows * self.row_bytes
        writes = tuple((row, *self.slot(j)) for j, row in enumerate(kept))
        return RoundRows(0, ctx.rows, self.kv_tokens, writes)

    def _record_salient(self, ctx: StepContext, keep: SaliencyKeep) -> RoundRows:
        """Sparse-dLLM's caching step: each layer stores the rows its selection keeps (a fixed count)."""
        kept = kept_count(ctx.rows, keep)
        device = self.device
        if self.lead and self.drop is None:
            self.drop = torch.zeros(self.row_layers, dtype=torch.int32, device=device)
        slots = [self.slot(j) for j in range(kept)]
        at = to_device([p for p, _ in slots] + [o for _, o in slots], torch.long, device).view(2, -1)
        store = SalientStore(
            keep, ctx.rows, ctx.block_start - self.lead if self.lead else -1, at[0], at[1], self.drop
        )
        self.cached_rows = kept
        self.stats.cache_bytes = max(self.stats.cache_bytes, kept * self.row_bytes)
        return RoundRows(0, ctx.rows, self.kv_tokens, store=store)

    def result(self) -> GenerationResult:
        result = super().result()
        result.cache = {"policy": self.policy.name, **self.stats.as_dict()}
        return result


def batch_session(
    model: DiffusionLM,
    built: Started,
    pages: list[int],
    page_size: int,
    device_sampler: bool = True,
) -> BatchSession:
    """A built request's session in the rounds: block diffusion, or under its batched decode policy, if it
    has one (SDAR's FOCUS: ``sdar_focus_rounds.py``)."""
    if isinstance(built, BlockDecode):
        from pdllm.decode_service.block_rounds import BlockBatchSession  # it builds on rounds.py only

        if built.focus is not None:
            from pdllm.decode_service.sdar_focus_rounds import SdarFocusSession

            return SdarFocusSession.begin(model, built, pages, page_size)

        return BlockBatchSession.begin(model, built, pages, page_size)
    if isinstance(built.cache_policy, DyLLMConfig):
        from pdllm.decode_service.dyllm_rounds import DyLLMBatchSession  # it builds on rounds.py only

        return DyLLMBatchSession.begin(model, built, pages, page_size)
    args = (model, built.query, built.query_start, built.kv_tokens, pages, built.gen)
    if built.cache_policy is None:
        return BatchSession.start(*args, device_sampler)
    kind = session_kind(built.cache_policy.name)
    return kind.start_policy(*args, built.cache_policy, page_size, device_sampler)


def session_kind(policy: str) -> type[PolicyBatchSession]:
    """The batched session class that runs decode policy ``policy`` (prefix-cache, dual-cache, sparse-dllm or polestar)."""
    if policy == "polestar":
        from pdllm.decode_service.polestar_rounds import PolestarBatchSession  # it builds on this module

        return PolestarBatchSession
    return PolicyBatchSession


@dataclass
class SalientStore:
    """A :data:`~.round_attention.LayerStore` for Sparse-dLLM's caching step: per layer, the session's selection
    (``keep``, from that layer's queries and keys of its ``rows`` local rows) stored into cache slots
    ``(pages[j], offsets[j])`` in row order, except ``lead`` (the row before the block, forwarded fresh by
    the cached steps), which goes last and is marked in ``drop[layer]``."""

    keep: SaliencyKeep
    rows: int
    lead: int  # -1: none
    pages: torch.Tensor
    offsets: torch.Tensor
    drop: torch.Tensor | None

    def __call__(
        self,
        layer: int,
        base: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention: PagedBatchAttention,
    ) -> None:
        own = slice(base, base + self.rows)
        kept = self.keep(layer, q[:, :, own], k[own].transpose(0, 1)[None])
        if self.lead >= 0:
            hit = kept == self.lead
            kept = kept[torch.argsort(hit.to(torch.int8), stable=True)]  # the lead row last
            assert self.drop is not None
            self.drop[layer] = hit.any().to(torch.int32)
        src = kept + base
        kv = attention.kv
        kv[layer, 0][self.pages, :, self.offsets] = k.index_select(0, src)
        kv[layer, 1][self.pages, :, self.offsets] = v.index_select(0, src)
