"""The in-process Prefilling-dLLM engine: the prefill worker's and the decode worker's phases in one process.

:meth:`PrefillingEngine.prefill` is what ``pdllm.v1.Prefill`` serves (steps 3-5: chunk prefill, scoring,
top-K selection; :class:`~pdllm.prefill_service.worker.PrefillWorker`), :meth:`PrefillingEngine.decode`
what ``pdllm.v1.Decode`` serves (steps 6-7: static KV build, denoising;
:class:`~pdllm.decode_service.worker.DecodeWorker`: the decode server's scheduler and batched rounds, driven
from the caller's thread), one request at a time; :meth:`generate` runs both. :meth:`prepare` (steps 3-6)
and :func:`decode_prepared` (step 7 of several requests in the same rounds) split it for ``eval``.
In process the :class:`Selection` goes from one phase to the other as it is, step-3 KV included, so
chunk-only reuses the prefill's causal chunk KV without a chunk-store round trip. The specification both
phases must match is ``pdllm.shared.reference``.

Step-3 KV is always computed with causal intra-chunk attention, because scoring needs it; with
``prefill_attention="bidirectional"`` the bidirectional chunk KV is computed only for the selected chunks
and only when ``kv_mode="chunk-only"`` reuses it (the other modes rebuild the chunk KV anyway). Both kinds
are cached in the chunk store under different position schemes.

SDAR (block-diffusion) models: selection is unchanged, the decode phase is exact block diffusion over the
selected prompt instead, plain or under FOCUS (``decode_service/sdar_decode.py`` explains it and what it
refuses), the decode worker's very code for an SDAR request.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.local import LocalDecoder, LocalJob
from pdllm.decode_service.sessions import check_policy_family
from pdllm.decode_service.worker import DecodeWorker
from pdllm.prefill_service.trace import Trace
from pdllm.prefill_service.worker import Ids, PrefillWorker, Selection
from pdllm.shared.chunk_store import ChunkKVStore, default_chunk_store
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.kv_write_policy import DEFAULT_KV_WRITE_POLICY, KVWritePolicy
from pdllm.shared.layout import Request, decode_layout
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV


class PrefillingEngine:
    """``store``: where step-3 chunk KV is reused across requests (None: a private in-process LRU unless
    ``reuse_chunks`` is False). ``decode_attention``, ``cuda_graph``: see
    :class:`~pdllm.decode_service.worker.DecodeWorker`; ``sentence_ends``, ``kv_write_policy`` (which chunk
    KV prefill writes to ``store``, ``shared/kv_write_policy.py``): see
    :class:`~pdllm.prefill_service.worker.PrefillWorker`."""

    def __init__(
        self,
        model: DiffusionLM,
        tokenizer: Any | None = None,
        config: EngineConfig | None = None,
        store: ChunkKVStore | None = None,
        decode_attention: str | None = None,
        reuse_chunks: bool = True,
        cuda_graph: bool = False,
        sentence_ends: Collection[int] | None = None,
        kv_write_policy: KVWritePolicy = DEFAULT_KV_WRITE_POLICY,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.config.validate()
        self.block_diffusion = sdar_decode.is_block_diffusion(model)
        if self.block_diffusion:  # fail at construction, not after a request's prefill
            sdar_decode.check_config(self.config, None, model)
        self.store: ChunkKVStore | None = (
            store if store is not None else (default_chunk_store() if reuse_chunks else None)
        )
        self.prefill_worker = PrefillWorker(
            model, tokenizer, self.config, self.store, sentence_ends, kv_write_policy=kv_write_policy
        )
        self.decode_worker = DecodeWorker(model, self.config, self.store, decode_attention, cuda_graph)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prefill(
        self,
        context: Ids,
        question: Ids,
        gen: GenerationConfig,
        instruction: Ids | None = None,
        config: EngineConfig | None = None,
    ) -> Selection:
        """Steps 3-5 (the prefill worker's phase): chunk prefill, scoring, top-K selection."""
        if self.block_diffusion:  # a per-request config may differ from the engine's
            sdar_decode.check_config(config or self.config, gen, self.model)
        return self.prefill_worker.prefill(context, question, gen, instruction, config)

    def build(self, sel: Selection, gen: GenerationConfig) -> StaticKV:
        """Step 6 (the first half of the decode worker's phase): the static decode KV of the selected chunks,
        top-B applied; records the build time and kept tokens in ``sel.trace``."""
        if self.block_diffusion:
            raise ValueError("SDAR models build a block-causal prefix cache in decode(), not a StaticKV")
        cfg, request, selected, trace = sel.config, sel.request, sel.selected, sel.trace
        with trace.phase("build", self.device):
            local: list[torch.Tensor] = []
            if cfg.kv_mode == "chunk-only" and cfg.prefill_attention == "causal":
                local = [sel.bank.segment(i) for i in selected]  # type: ignore[union-attr]
            elif cfg.kv_mode == "chunk-only":
                local, hits = self.decode_worker.chunk_kv([request.chunks[i] for i in selected], cfg)
                trace.cache_hits += hits
                trace.cache_misses += len(selected) - hits
            static = self.decode_worker.build_selected(request, selected, gen, cfg, local)
        trace.kept_tokens = static.kept_tokens
        return static

    def decode(
        self,
        sel: Selection,
        gen: GenerationConfig,
        progress: bool = False,
        decode_policy: DecodePolicyConfig | None = None,
    ) -> GenerationResult:
        """Steps 6-7 (the decode worker's phase) for ``sel``; fills the build and decode fields of its
        trace. ``decode_policy``: which query/response rows each step recomputes (``decode_service/policies``;
        None or ``none``: all of them)."""
        prepared = self.prepare_decode(sel, gen, decode_policy)
        with sel.trace.phase("decode", self.device):  # the decode server's scheduler
            result = self.decode_worker.local.run(prepared.job, progress)
        return prepared.finish(result)

    def prepare_decode(
        self, sel: Selection, gen: GenerationConfig, decode_policy: DecodePolicyConfig | None = None
    ) -> PreparedDecode:
        """Step 6 for ``sel`` (its build phase in the trace): the static KV, or on SDAR the block-causal
        prefix cache; its step 7 is the returned job, run alone (:meth:`decode`) or with others
        (:func:`decode_prepared`)."""
        if self.block_diffusion:
            return self._prepare_block_diffusion(sel, gen, decode_policy)
        static = self.build(sel, gen)
        sel.bank = None  # the step-3 KV is not needed past the build
        job = self.decode_worker.decode_job(sel.request.query, static, gen, decode_policy)
        return PreparedDecode(sel, job)

    def _prepare_block_diffusion(
        self, sel: Selection, gen: GenerationConfig, decode_policy: DecodePolicyConfig | None
    ) -> PreparedDecode:
        """Step 6 on SDAR: the block-causal prefix cache; its step 7 is block diffusion over it (under FOCUS
        when ``decode_policy`` is focus, its counters in the result's ``cache``); same trace fields as the
        static build (every token of a selected chunk is kept: no top-B)."""
        sdar_decode.check_config(sel.config, gen, self.model)
        sdar_decode.check_decode_options(decode_policy, None)
        request = sel.request  # the selected chunks, in order: what a decode worker is sent
        request = Request(request.instruction, [request.chunks[i] for i in sel.selected], request.query)
        layout = decode_layout(request, list(range(len(request.chunks))), gen.gen_length)
        with sel.trace.phase("build", self.device):
            prefix = sdar_decode.build_prefix(self.model, request, layout, gen)
        sel.trace.kept_tokens = list(layout.chunk_lens)
        sel.bank = None
        return PreparedDecode(sel, self.decode_worker.sdar_job(request, gen, prefix, decode_policy))

    def prepare(
        self,
        context_ids: Ids,
        question_ids: Ids,
        gen: GenerationConfig,
        instruction_ids: Ids | None = None,
        decode_policy: DecodePolicyConfig | None = None,
    ) -> PreparedDecode:
        """Steps 3-6 of one request: what :meth:`generate` does before its denoising."""
        if self.block_diffusion:  # refuse before the prefill, not after it
            sdar_decode.check_decode_options(decode_policy, None)
        else:
            check_policy_family(decode_policy, self.model)
        sel = self.prefill(context_ids, question_ids, gen, instruction_ids)
        return self.prepare_decode(sel, gen, decode_policy)

    def generate(
        self,
        context_ids: Ids,
        question_ids: Ids,
        gen: GenerationConfig,
        instruction_ids: Ids | None = None,
        progress: bool = False,
        decode_policy: DecodePolicyConfig | None = None,
    ) -> tuple[GenerationResult, Trace]:
        if self.block_diffusion:  # refuse before the prefill, not after it
            sdar_decode.check_decode_options(decode_policy, None)
        else:
            check_policy_family(decode_policy, self.model)
        sel = self.prefill(context_ids, question_ids, gen, instruction_ids)
        result = self.decode(sel, gen, progress=progress, decode_policy=decode_policy)
        return result, sel.trace


@dataclass
class PreparedDecode:
    """A pdllm request with steps 3-6 done: its selection (``sel``, trace included) and its step-7 job."""

    sel: Selection
    job: LocalJob

    def finish(self, result: GenerationResult) -> GenerationResult:
        """The decode fields of the trace (steps, peak memory) and the result's phase timings; a decode
        phase not timed around this request alone is its wall time to the result."""
        trace = self.sel.trace
        trace.timings.setdefault("decode", result.decode_seconds)
        trace.decode_steps = result.steps
        trace.peak_memory_bytes, trace.memory_kind = self.sel.meter.peak()
        result.timings = dict(trace.timings)
        return result


def decode_prepared(
    local: LocalDecoder, prepared: Sequence[PreparedDecode], progress: bool = False
) -> list[GenerationResult]:
    """Step 7 of ``prepared`` together (one round forwards all of them) on ``local``: any decoder of the
    same model, so requests of engines with different settings share its rounds; results in order, their
    traces filled as :meth:`PrefillingEngine.decode` fills them."""
    results = local.run_many([p.job for p in prepared], progress)
    return [p.finish(r) for p, r in zip(prepared, results, strict=True)]
