"""One decode request on the scheduler: its explicit status, its pool pages, the session it becomes, and the
events (partial outputs, the final result) its caller reads."""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdllm.decode_service.device_state import DeviceDenoiseState
from pdllm.decode_service.kv_pool import PooledKV
from pdllm.decode_service.kv_receiver import Transfer
from pdllm.decode_service.policies import CachePolicy
from pdllm.shared.decode_policy import DyLLMConfig, FocusConfig
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.static_kv import StaticKV
from pdllm.shared.stepwise import Steps


@dataclass
class Partial:
    step: int
    block: int
    tokens: list[int]  # -1 = still masked


@dataclass
class Final:
    result: GenerationResult
    build_s: float
    queue_s: float
    peak_bytes: int  # this request's own: its KV pages plus its build's transient memory
    # Its KV pool pages (static KV plus a policy's cache) when it finished, and the most it held at once. A
    # policy that evicts reserves only what it keeps (Sparse-dLLM's count is known at admission), so the two
    # are equal and are what the pool's byte budget charged it.
    pool_bytes: int = 0
    pool_peak_bytes: int = 0


@dataclass
class StaticDecode:
    """A session ready to join the batched rounds: its local tokens before the response (pdllm: the query
    suffix; vanilla: the whole prompt), its static KV (built, or pulled straight into its pages; None for
    vanilla, which attends to its own rows only) and settings."""

    query: list[int]
    static: StaticKV | PooledKV | None
    gen: GenerationConfig
    cache_stats: tuple[int, int] = (0, 0)  # KV tier hits / misses of its chunks (chunk-only)
    kv_source: str = "built"  # "built" | "handoff" | "handoff-failed-rebuilt"
    # The decode policy its session runs under in the rounds: a caching one (``policy_rounds.py``) or
    # DyLLM's knobs (``dyllm_rounds.py``); None: plain steps.
    cache_policy: CachePolicy | DyLLMConfig | None = None

    @property
    def query_start(self) -> int:
        """Position of the first local token."""
        return 0 if self.static is None else self.static.query_start

    @property
    def kv_tokens(self) -> int:
        """Static KV tokens it reads from its pages."""
        return 0 if self.static is None else self.static.num_tokens


@dataclass
class BlockDecode:
    """A block-diffusion (SDAR) request ready to join the batched rounds: its prompt, the K/V of the
    prompt's whole generation blocks (``static``, slot = position; None when it has none) and settings."""

    prompt: list[int]
    static: StaticKV | None
    gen: GenerationConfig
    cache_stats: tuple[int, int] = (0, 0)  # as StaticDecode's (a block-causal build reads no chunk KV)
    kv_source: str = "built"
    prefill_s: float = 0.0  # the build's wall time: the prompt's whole blocks recorded
    focus: FocusConfig | None = None  # FOCUS's knobs: its steps in the rounds (``sdar_focus_rounds.py``)


Started = StaticDecode | BlockDecode
"""What a request's ``start`` returns: what joins the batched rounds once built (its ``static`` placed in its
pool pages)."""


class Session(Protocol):
    """What the scheduler reads of a running request's session in the rounds: its denoising state (steps taken, block), whether it is done,
    its partial output and its result."""

    @property
    def state(self) -> DenoiseState | DeviceDenoiseState: ...

    @property
    def done(self) -> bool: ...

    def partial(self) -> list[int]: ...

    def result(self) -> GenerationResult: ...


class Status(enum.Enum):
    """Where a request is. The scheduler moves it forward, one way: WAITING -> (PULLING ->) BUILDING ->
    RUNNING -> FINISHED; CANCELLED or FAILED from any state before FINISHED."""

    WAITING = "waiting"  # queued, no pages yet
    PULLING = "pulling"  # pages reserved, its KV being pulled from a prefill worker (a handoff)
    BUILDING = "building"  # its session being made: the build on the device, whole or in pieces
    RUNNING = "running"  # a step every iteration, in the rounds
    FINISHED = "finished"  # its result published, its pages back in the pool
    CANCELLED = "cancelled"  # its caller left; its pages back in the pool
    FAILED = "failed"  # an error published to its caller; its pages back in the pool

    @property
    def done(self) -> bool:
        return self in (Status.FINISHED, Status.CANCELLED, Status.FAILED)


@dataclass
class Build:
    """A request's build in progress (status BUILDING)."""

    steps: Steps[StaticDecode] | None = None  # run piece by piece between rounds (build_pieces)
    made: Started | None = None  # what ``start`` returned, launched on the build stream
    done: torch.cuda.Event | None = None  # its device work (CUDA): it joins once this has passed


@dataclass
class DecodeRequest:
    """``start`` makes the request's session on the scheduler thread, which owns the device (a pdllm
    request's build runs in it); ``start_steps``: the same build in pieces of N layers (None: whole only);
    ``fetch``: starts pulling a handed-off KV into ``pages`` (its build then uses it, or rebuilds it)."""

    request_id: str
    start: Callable[[], Started]
    cancelled: threading.Event
    stream_partials: bool = True
    kv_tokens: int = 0  # static KV tokens it will hold in the pool (an upper bound; 0: none)
    cache_tokens: int = 0  # pool slots beyond its static KV (a caching decode policy's cache)
    start_steps: Callable[[int], Steps[StaticDecode]] | None = None
    fetch: Callable[[], Transfer] | None = None
    status: Status = Status.WAITING
    events: queue.Queue = field(default_factory=queue.Queue)
    pages: list[int] = field(default_factory=list)
    transfer: Transfer | None = None  # its pull (PULLING); ``received`` once it finished
    received: Transfer | None = None
    build: Build | None = None
    session: Session | None = None  # RUNNING
    # what its result reports
    submitted: float = field(default_factory=time.perf_counter)
    build_started: float = 0.0
    queue_s: float = 0.0
    build_s: float = 0.0
    build_bytes: int = 0
    pool_peak_bytes: int = 0  # the most KV pool bytes its pages held at once
    cache_stats: tuple[int, int] = (0, 0)  # KV tier hits / misses of its chunks (chunk-only)
    kv_source: str = "built"

    @property
    def pool_tokens(self) -> int:
        """Slots the request reserves in the KV pool."""
        return self.kv_tokens + self.cache_tokens

    def pull_over(self) -> bool:
        """Its pull has finished, or it was cancelled and the pull no longer writes into its pages (a
        cancelled request's pages go back only then: another request may get them next)."""
        t = self.transfer
        return t is not None and (t.finished or (self.cancelled.is_set() and t.detach()))

    def stream(self, poll_s: float = 0.5) -> Iterator[Partial | Final]:
        """Events until the final result; re-raises a failure; stops early if the call was cancelled."""
        while True:
            try:
                event = self.events.get(timeout=poll_s)
            except queue.Empty:
                if self.cancelled.is_set():
                    return
                continue
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Final):
                return
