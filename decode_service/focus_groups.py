"""SDAR's FOCUS requests on the decode worker, batched: one packed FOCUS forward per scheduler iteration for
every FOCUS request of a group, so that what eviction saves in one request makes room for others (the
paper's "effective batch grows", §4). Dream/LLaDA FOCUS requests ride in the batched rounds instead
(``focus_rounds.py``); SDAR's stay here: their windows span several model blocks, block-causal between
them, which the rounds' per-entry key regions do not express yet.

A group is a :class:`~pdllm.decode_service.policies.focus_batch.FocusDecodeBatch` (FOCUS's fast path, held
token for token to the reference loop by its tests) of requests that share the generation config and the
FOCUS knobs (block diffusion over each request's exact cache, pdllm's continuing its block-causal prefix);
requests with other settings form other groups, and a full group (``slots`` requests) starts another.
Each request holds a :class:`FocusMember` as its session; a member has no step of its own: the scheduler
steps each member's ``group`` once per iteration (``policy_sessions.step_alone``), so every member
advances by exactly one denoising step per iteration and emits one partial. A member whose request is
done or cancelled leaves its group at the group's next step (its block-K/V slot is reused).
"""

from __future__ import annotations

import threading
import time

import torch

from pdllm.decode_service.block_diffusion import BlockKVCache
from pdllm.decode_service.policies.focus import FocusConfig
from pdllm.decode_service.policies.focus_batch import BatchedRequest, FocusDecodeBatch
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


class FocusMember:
    """One request's place in a :class:`FocusGroup`: the request's session (``state``, ``done``,
    ``partial``, ``result``, as a ``DenoiseSession``'s; stepped through its ``group``)."""

    def __init__(self, group: FocusGroup, request: BatchedRequest, cancelled: threading.Event) -> None:
        self.group, self.request, self.cancelled = group, request, cancelled
        self.seconds = 0.0  # group steps while a member, in seconds

    @property
    def state(self) -> DenoiseState:
        return self.request.state

    @property
    def done(self) -> bool:
        return self.request.state.done

    def partial(self) -> list[int]:
        """Response slots so far, -1 where still masked."""
        mask = self.state.mask_id
        return [-1 if t == mask else t for t in self.state.tokens.tolist()]

    def result(self) -> GenerationResult:
        return self.group.batch.result(self.request, self.seconds)


class FocusGroup:
    """FOCUS requests of one generation config and one set of knobs, stepped as one packed batch."""

    def __init__(self, model: DiffusionLM, gen: GenerationConfig, focus: FocusConfig, slots: int) -> None:
        self.batch = FocusDecodeBatch(model, gen, focus, slots)
        self.members: list[FocusMember] = []

    def add(self, request: BatchedRequest, cancelled: threading.Event) -> FocusMember:
        member = FocusMember(self, request, cancelled)
        self.members.append(member)
        return member

    def prune(self) -> None:
        """Members whose request is done or cancelled leave (their slots are free again)."""
        for member in [m for m in self.members if m.done or m.cancelled.is_set()]:
            self.batch.remove(member.request)
            self.members.remove(member)

    def step(self) -> None:
        """One denoising step of every member, in one packed forward."""
        self.prune()
        if not self.members:
            return
        start = time.perf_counter()
        self.batch.step()  # synchronous: it reads its selection and the sampler's predictions
        seconds = time.perf_counter() - start
        for member in self.members:
            member.seconds += seconds


class FocusGroups:
    """The decode worker's FOCUS groups (scheduler thread only)."""

    def __init__(self, model: DiffusionLM, slots: int = 64) -> None:
        self.model, self.slots = model, slots
        self.groups: dict[tuple[GenerationConfig, FocusConfig], list[FocusGroup]] = {}

    def join_block_diffusion(
        self,
        prompt: torch.Tensor,
        gen: GenerationConfig,
        focus: FocusConfig,
        cancelled: threading.Event,
        prefix: BlockKVCache | None = None,
    ) -> FocusMember:
        """An SDAR member: block diffusion of ``prompt`` (its prefill runs now), continuing ``prefix`` when
        given (pdllm's block-causal cache of ``[instruction, chunks]``)."""
        group = self._group(gen, focus)
        return group.add(group.batch.block_diffusion(prompt, prefix), cancelled)

    def _group(self, gen: GenerationConfig, focus: FocusConfig) -> FocusGroup:
        """A group of these settings with a free slot. Groups left empty, of any settings, are dropped here
        (their block-K/V stores with them)."""
        for key, kept in list(self.groups.items()):
            for group in kept:
                group.prune()
            kept[:] = [g for g in kept if g.members]
            if not kept:
                del self.groups[key]
        groups = self.groups.setdefault((gen, focus), [])
        group = next((g for g in groups if not g.batch.full), None)
        if group is None:
            group = FocusGroup(self.model, gen, focus, self.slots)
            groups.append(group)
        return group
