"""Steps 6-7 of one model, what ``pdllm.v1.Decode`` serves: the static KV build, then denoising.

:class:`DecodeWorker` builds the static decode KV of the selected chunks (``build.py``); in chunk-only mode
it starts from their step-3 KV, loaded from the chunk store or recomputed on a miss
(:meth:`DecodeWorker.chunk_kv`). Step 7 runs in the batched rounds (``scheduler.py``, ``rounds.py``): the
decode server's scheduler thread for all its requests, and :meth:`DecodeWorker.decode` /
:meth:`DecodeWorker.vanilla` (the in-process engine, ``generate``, ``eval``) through the same scheduler
driven from the caller's thread (``local.py``), replaying graphed rounds with ``cuda_graph``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.block_diffusion import BlockKVCache
from pdllm.decode_service.build import build_static_steps
from pdllm.decode_service.local import LocalDecoder, LocalJob
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.round_graphs import CAPTURE_NEEDS_TRITON
from pdllm.decode_service.sessions import SessionMaker, rounds_policy
from pdllm.kernels import HAS_TRITON
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.chunk_store import ChunkKVStore
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.layout import DecodeLayout, Request, decode_layout
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV
from pdllm.shared.stepwise import Steps, drain

DECODE_ATTENTIONS = ("torch", "triton")
"""The rounds' attention: the split-S kernel ("triton": CUDA, or Triton's interpreter off it with
``TRITON_INTERPRET=1``) or each request's pages gathered and one SDPA call ("torch", any device)."""


def default_decode_attention(device: torch.device) -> str:
    """ "triton" on CUDA with Triton installed, else "torch"."""
    return "triton" if device.type == "cuda" and HAS_TRITON else "torch"


class DecodeWorker:
    """``config``: the default settings of a request (a request may carry its own). ``store``: where the
    chunk-only build finds step-3 chunk KV (None: always recomputed). ``decode_attention``: the rounds'
    attention, one of :data:`DECODE_ATTENTIONS` (default :func:`default_decode_attention`). ``cuda_graph``:
    replay the rounds as CUDA graphs."""

    def __init__(
        self,
        model: DiffusionLM,
        config: EngineConfig | None = None,
        store: ChunkKVStore | None = None,
        decode_attention: str | None = None,
        cuda_graph: bool = False,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.config.validate()
        self.store = store
        self._gpu_kernels = HAS_TRITON and self.device.type == "cuda"
        if decode_attention is None:
            decode_attention = default_decode_attention(self.device)
        if decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTIONS}, got {decode_attention!r}")
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if decode_attention == "triton" and not (self._gpu_kernels or (HAS_TRITON and interpreted)):
            raise ValueError('decode_attention "triton" needs CUDA with Triton, or TRITON_INTERPRET=1')
        if cuda_graph and decode_attention == "torch" and self.device.type == "cuda":
            raise ValueError(CAPTURE_NEEDS_TRITON)  # before a request, not at its first round
        self.decode_attention = decode_attention
        self.cuda_graph = cuda_graph
        self.local = LocalDecoder(model, decode_attention, cuda_graph)
        self.sessions = SessionMaker(model, self.local.page_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def chunk_kv(
        self, chunks: Sequence[Sequence[int]], config: EngineConfig | None = None
    ) -> tuple[list[torch.Tensor], int]:
        """Step-3 KV of ``chunks`` in the config's prefill attention, from the store or computed (chunk-only).

        Returns the segments and how many came from the store."""
        cfg = config or self.config
        # Packed flash varlen beats masked, padded SDPA for bidirectional chunks on an H100 (0.33-0.81x at
        # C >= 512, benchmarks/results/prefill_kernels.md); for causal ones the padded call is as fast.
        varlen = self._gpu_kernels and cfg.prefill_attention == "bidirectional"
        kv, stats = chunk_prefill(
            self.model,
            chunks,
            cfg.prefill_attention,
            cfg.chunk_size,
            cfg.prefill_batch,
            self.store,
            kernel="varlen" if varlen else "sdpa",
        )
        return [kv.segment(j) for j in range(len(chunks))], stats.hits

    def build(
        self,
        request: Request,
        layout: DecodeLayout,
        config: EngineConfig | None = None,
        local: Sequence[torch.Tensor] = (),
    ) -> StaticKV:
        """Step 6: the static decode KV of the selected chunks (``local``: their step-3 KV, chunk-only)."""
        return drain(self.build_steps(request, layout, config, local))

    def build_selected(
        self,
        request: Request,
        selected: Sequence[int],
        gen: GenerationConfig,
        config: EngineConfig | None = None,
        local: Sequence[torch.Tensor] = (),
    ) -> StaticKV:
        """Step 6 for a selection: the decode layout of the ``selected`` chunks (in that order, with room for
        ``gen.gen_length`` answer tokens), then :meth:`build`. The in-process engine's build and a prefill
        worker's handed-off build (``prefill_service.handoff.DecodeKVBuild``) are both this call."""
        return self.build(request, decode_layout(request, selected, gen.gen_length), config, local)

    def build_steps(
        self,
        request: Request,
        layout: DecodeLayout,
        config: EngineConfig | None = None,
        local: Sequence[torch.Tensor] = (),
        layers_per_step: int | None = None,
    ) -> Steps[StaticKV]:
        """:meth:`build` in pieces of ``layers_per_step`` layers of its forward."""
        cfg = config or self.config
        # The retention kernel is 3-12x faster than the torch probe for bidirectional scores, and no faster
        # for query-to-chunk ones (benchmarks/results/prefill_kernels.md).
        triton = self._gpu_kernels and cfg.retention_score == "bidirectional"
        retention = "triton" if triton else "torch"
        return build_static_steps(self.model, request, layout, cfg, local, retention, layers_per_step)

    def decode(
        self,
        query_ids: list[int],
        static: StaticKV,
        gen: GenerationConfig,
        progress: bool = False,
        decode_policy: DecodePolicyConfig | None = None,
    ) -> GenerationResult:
        """Step 7 for one request over ``static`` under ``decode_policy`` (None: every row every step),
        through the decode server's scheduler (:class:`~.local.LocalDecoder`; the session it becomes:
        ``sessions.py``)."""
        job = self.decode_job(query_ids, static, gen, decode_policy)
        return self.local.run(job, progress, threading.Event())

    def decode_job(
        self,
        query_ids: list[int],
        static: StaticKV,
        gen: GenerationConfig,
        decode_policy: DecodePolicyConfig | None = None,
    ) -> LocalJob:
        """:meth:`decode`'s request, for :meth:`LocalDecoder.run_many <.local.LocalDecoder.run_many>`."""
        gen.validate()
        built = StaticDecode(list(query_ids), static, gen, cache_policy=rounds_policy(decode_policy))
        slots = self.sessions.pool_slots(decode_policy, len(query_ids), gen, static=True)
        return LocalJob(lambda: built, built.kv_tokens, slots, gen)

    def vanilla(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        decode_policy: DecodePolicyConfig | None = None,
        progress: bool = False,
    ) -> GenerationResult:
        """A vanilla request (``prompt``: BOS included, if any) through the decode server's scheduler: in the
        rounds with its whole prompt as local rows (``sessions.py``)."""
        return self.local.run(self.vanilla_job(prompt, gen, decode_policy), progress, threading.Event())

    def vanilla_job(
        self, prompt: list[int], gen: GenerationConfig, decode_policy: DecodePolicyConfig | None = None
    ) -> LocalJob:
        """:meth:`vanilla`'s request, for :meth:`LocalDecoder.run_many <.local.LocalDecoder.run_many>`."""
        gen.validate()
        if self.sessions.block_diffusion:
            sdar_decode.check_generation(gen, self.model)
        slots = self.sessions.pool_slots(decode_policy, len(prompt), gen, static=False)
        start = lambda: self.sessions.vanilla(list(prompt), gen, decode_policy)  # noqa: E731
        return LocalJob(start, 0, slots, gen)

    def sdar(
        self,
        request: Request,
        gen: GenerationConfig,
        prefix: BlockKVCache,
        decode_policy: DecodePolicyConfig | None = None,
        progress: bool = False,
    ) -> GenerationResult:
        """A pdllm request on SDAR (``request``: its selected chunks, in order) from its built block-causal
        ``prefix``, through the decode server's scheduler."""
        return self.local.run(self.sdar_job(request, gen, prefix, decode_policy), progress, threading.Event())

    def sdar_job(
        self,
        request: Request,
        gen: GenerationConfig,
        prefix: BlockKVCache,
        decode_policy: DecodePolicyConfig | None = None,
    ) -> LocalJob:
        """:meth:`sdar`'s request, for :meth:`LocalDecoder.run_many <.local.LocalDecoder.run_many>`."""
        prompt = len(request.instruction) + sum(map(len, request.chunks)) + len(request.query)
        slots = self.sessions.pool_slots(decode_policy, prompt, gen, static=True)
        start = lambda: self.sessions.sdar(request, gen, decode_policy, prefix)  # noqa: E731
        return LocalJob(start, 0, slots, gen)
