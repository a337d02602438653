"""What the decode scheduler holds per request: the job a server hands over, the session it becomes,
and the events (partial outputs, the final result) the job's caller reads."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pdllm.decode_service.kv_pool import PooledKV
from pdllm.decode_service.rounds import BatchSession
from pdllm.shared.generation.block_diffusion import BlockDiffusionSession
from pdllm.shared.generation.policies import CachePolicy
from pdllm.shared.generation.sampler import DenoiseSession, GenerationConfig, GenerationResult
from pdllm.shared.kv_transfer.receiver import Transfer
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
    # A batched decode policy (policy_rounds.BATCHED_POLICIES): the session joins the rounds under it.
    cache_policy: CachePolicy | None = None

    @property
    def query_start(self) -> int:
        """Position of the first local token."""
        return 0 if self.static is None else self.static.query_start

    @property
    def kv_tokens(self) -> int:
        """Static KV tokens it reads from its pages."""
        return 0 if self.static is None else self.static.num_tokens


# Stepped alone (not in the batched rounds): a denoising loop, or an SDAR request's block diffusion.
AloneSession = DenoiseSession | BlockDiffusionSession
Session = BatchSession | AloneSession


@dataclass
class DecodeJob:
    request_id: str
    # Builds the session's decode KV (StaticDecode) or a session stepped alone (AloneSession); runs on
    # the scheduler thread, which owns the device.
    start: Callable[[], StaticDecode | AloneSession]
    cancelled: threading.Event
    stream_partials: bool = True
    # Static KV tokens the session will hold in the pool (an upper bound; 0: it holds none).
    kv_tokens: int = 0
    # Pool slots beyond the static KV (a batched decode policy's cache of the query + answer rows).
    cache_tokens: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    session: Session | None = None
    pages: list[int] = field(default_factory=list)
    queue_s: float = 0.0
    build_s: float = 0.0
    build_bytes: int = 0
    cache_stats: tuple[int, int] = (0, 0)
    # The same build as ``start`` in pieces of N layers (pdllm sessions), for SchedulerConfig.build_pieces;
    # None: the job's build can only run whole.
    start_steps: Callable[[int], Steps[StaticDecode]] | None = None
    build_steps: Steps[StaticDecode] | None = None  # a build being run piece by piece
    built: StaticDecode | AloneSession | None = None  # launched build, until it joins the rounds
    built_event: torch.cuda.Event | None = None  # its device work is done (CUDA)
    build_started: float = 0.0
    # Starts pulling the request's KV from a prefill worker (a handoff), into ``pages`` for a decode KV; the
    # scheduler runs the build only once the pull has finished (and frees the pages of a cancelled job only
    # once nothing writes into them), and ``start`` / ``start_steps`` then use the pulled KV or rebuild it.
    fetch: Callable[[], Transfer] | None = None
    transfer: Transfer | None = None  # the pull, from launch until it finished
    received: Transfer | None = None  # the finished pull
    kv_source: str = "built"

    @property
    def pool_tokens(self) -> int:
        """Slots the job reserves in the KV pool."""
        return self.kv_tokens + self.cache_tokens

    def pull_over(self) -> bool:
        """Its pull has finished, or it was cancelled and the pull no longer writes into its pages (a
        cancelled job's pages go back only then: another job may get them next)."""
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
