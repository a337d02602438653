"""The in-process Prefilling-dLLM engine: prefill -> score -> select -> KV build -> decode.

``PrefillingEngine.generate`` runs one request end to end on the fast path; ``prefill`` and ``decode`` are
the same two halves the prefill and decode services run on different workers (``PrefillResult.static`` is
what travels between them). The specification both halves must match is
``pdllm.prefill_service.reference``. Phases and conventions are documented in the modules they live in:
``prefill_service.layout`` (prompt layout, positions), ``prefill``/``scoring``/``build`` (steps 3-6) and
``decode_service.decode`` (step 7, decode policies).

Step-3 KV is always computed with causal intra-chunk attention, because scoring needs it; with
``prefill_attention="bidirectional"`` the bidirectional chunk KV is computed only for the selected chunks
and only when ``kv_mode="chunk-only"`` reuses it (the other modes rebuild the chunk KV anyway). Both kinds
are cached in the chunk store under different position schemes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdllm.decode_service.decode import DECODE_ATTENTIONS, DecodePolicy, StaticKV, StaticPolicy, decode
from pdllm.decode_service.graphs import GraphCache
from pdllm.kernels import HAS_TRITON
from pdllm.prefill_service.attention import ChunkBank
from pdllm.prefill_service.build import build_static
from pdllm.prefill_service.config import EngineConfig
from pdllm.prefill_service.layout import (
    DecodeLayout,
    Request,
    decode_layout,
    make_request,
    select_top_k,
    sentence_end_ids,
)
from pdllm.prefill_service.prefill import chunk_prefill
from pdllm.prefill_service.reference import ChunkScore
from pdllm.prefill_service.scoring import score_chunks
from pdllm.prefill_service.store import ChunkKVStore, chunk_keys, default_chunk_store, position_scheme
from pdllm.prefill_service.trace import MemoryMeter, Trace
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM

__all__ = ["EngineConfig", "PrefillResult", "PrefillingEngine", "SelectJob", "Selection", "Trace"]

Ids = Sequence[int] | torch.Tensor | str


@dataclass
class Selection:
    """Steps 3-5 of one request: what a prefill worker returns (``keys``: step-3 KV of every chunk)."""

    request: Request
    scores: list[ChunkScore]
    selected: list[int]
    trace: Trace
    meter: MemoryMeter
    bank: ChunkBank | None
    keys: list[str]
    position_scheme: str


@dataclass(frozen=True)
class SelectJob:
    """A validated request waiting for steps 3-5 (see :meth:`PrefillingEngine.select_many`)."""

    request: Request
    gen: GenerationConfig
    config: EngineConfig

    @property
    def num_context_tokens(self) -> int:
        return sum(len(c) - 1 for c in self.request.chunks)


@dataclass
class PrefillResult:
    request: Request
    layout: DecodeLayout
    static: StaticKV
    scores: list[ChunkScore]
    selected: list[int]
    trace: Trace
    meter: MemoryMeter


def default_decode_attention(device: torch.device, cuda_graph: bool) -> str:
    """Decode attention when none is named. "triton" for CUDA-graph decode: faster than "buffer" at every
    length measured (9.9 vs 11.0 ms per Dream-7B step on an H100, benchmarks/results/e2e_notes.md).
    "buffer" for eager CUDA decode, where the split-S launcher's Python dispatch (120-300 µs per call,
    attention_notes.md) would outweigh the kernel. "segments" off CUDA."""
    if device.type != "cuda":
        return "segments"
    return "triton" if cuda_graph and HAS_TRITON else "buffer"


class PrefillingEngine:
    """``store``: where step-3 chunk KV is reused across requests (None: a private in-process LRU unless
    ``reuse_chunks`` is False). ``decode_attention`` (default: :func:`default_decode_attention`): "segments"
    (split over static segments, LSE merge), "buffer" (one preallocated contiguous buffer, SDPA) or "triton"
    (split-S kernel over paged static KV).
    ``cuda_graph``: replay the decode step (CUDA). ``sentence_ends``: token ids that end a sentence, for
    ``chunk_boundary="sentence"`` (None: computed once from the tokenizer when first needed)."""

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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.config.validate()
        if decode_attention is None:
            decode_attention = default_decode_attention(self.device, cuda_graph)
        if decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTIONS}, got {decode_attention!r}")
        self.decode_attention = decode_attention
        self.cuda_graph = cuda_graph
        self.graph_cache = GraphCache() if cuda_graph else None
        self.store: ChunkKVStore | None = (
            store if store is not None else (default_chunk_store() if reuse_chunks else None)
        )
        self._sentence_ends = frozenset(sentence_ends) if sentence_ends is not None else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sentence_ends(self, config: EngineConfig | None = None) -> frozenset[int] | None:
        """The sentence-end token ids ``config`` needs for its chunk layout (None for fixed chunks)."""
        if (config or self.config).chunk_boundary != "sentence":
            return None
        if self._sentence_ends is None:
            if self.tokenizer is None:
                raise ValueError(
                    "chunk_boundary='sentence' needs a tokenizer (or explicit sentence_ends) to find sentence ends"
                )
            self._sentence_ends = sentence_end_ids(self.tokenizer)
        return self._sentence_ends

    def _ids(self, name: str, value: Ids | None) -> list[int] | torch.Tensor | None:
        if not isinstance(value, str):
            return value
        if self.tokenizer is None:
            raise ValueError(f"{name} was given as text but the engine has no tokenizer; pass token ids")
        return list(self.tokenizer.encode(value, add_special_tokens=False))

    def select(
        self,
        context: Ids,
        question: Ids,
        gen: GenerationConfig,
        instruction: Ids | None = None,
        config: EngineConfig | None = None,
    ) -> Selection:
        """Steps 3-5 (what a prefill worker runs): chunk prefill, scoring, top-K selection."""
        job = self.job(context, question, gen, instruction, config)
        out = self.select_many([job])[0]
        if isinstance(out, ValueError):
            raise out
        return out

    def job(
        self,
        context: Ids,
        question: Ids,
        gen: GenerationConfig,
        instruction: Ids | None = None,
        config: EngineConfig | None = None,
    ) -> SelectJob:
        """One validated request for :meth:`select_many` (ValueError on bad input)."""
        gen.validate()
        cfg = config or self.config
        request = make_request(
            self._ids("context", context),  # type: ignore[arg-type]
            self._ids("question", question),  # type: ignore[arg-type]
            self.model.config.bos_token_id,
            cfg,
            self.model.config.vocab_size,
            self._ids("instruction", instruction),  # type: ignore[arg-type]
            self.sentence_ends(cfg),
        )
        return SelectJob(request, gen, cfg)

    def select_many(self, jobs: Sequence[SelectJob]) -> list[Selection | ValueError]:
        """Steps 3-5 for several requests at once: the chunks of all requests that share a chunk size are
        prefilled in the same batched forwards (a chunk two requests share is forwarded once), then every
        request is scored and selected on its own. Results equal :meth:`select` on each request alone."""
        out: list[Selection | ValueError] = [ValueError("not run")] * len(jobs)
        groups: dict[tuple[int, int], list[int]] = {}
        for j, job in enumerate(jobs):
            groups.setdefault((job.config.chunk_size, job.config.prefill_batch), []).append(j)
        for (chunk_size, batch), members in groups.items():
            unique: dict[tuple[int, ...], int] = {}
            rows: list[list[int]] = []
            for j in members:
                rows.append([unique.setdefault(tuple(c), len(unique)) for c in jobs[j].request.chunks])
            meter = MemoryMeter(self.device)  # shared: the batch's peak is every member's peak
            timer = Trace()
            chunks = [list(c) for c in unique]
            dtype = next(self.model.parameters()).dtype
            keys = chunk_keys(self.model.config.model_id, dtype, chunk_size, "causal", chunks)  # hashed once
            with timer.phase("prefill", self.device):
                bank, stats = chunk_prefill(self.model, chunks, "causal", chunk_size, batch, self.store, keys)
            hit = set(stats.hit_rows)
            for j, idx in zip(members, rows):
                request = jobs[j].request
                trace = Trace(num_chunks=request.num_chunks, context_tokens=jobs[j].num_context_tokens)
                trace.timings["prefill"] = timer.timings["prefill"]
                trace.cache_hits = sum(i in hit for i in idx)
                trace.cache_misses = len(idx) - trace.cache_hits
                trace.prefill_skipped = trace.cache_misses == 0  # all its chunks came from the store
                try:
                    out[j] = self._score_select(jobs[j], trace, meter, bank.take(idx), [keys[i] for i in idx])
                except ValueError as exc:  # one request's problem is not its batch-mates'
                    out[j] = exc
        return out

    def _score_select(
        self, job: SelectJob, trace: Trace, meter: MemoryMeter, bank: ChunkBank, keys: list[str]
    ) -> Selection:
        model, device, cfg, request = self.model, self.device, job.config, job.request
        with trace.phase("score", device):
            scores = score_chunks(model, request, cfg, bank)
        with trace.phase("select", device):
            selected = select_top_k([s.total for s in scores], cfg.top_k)
        trace.chunk_scores = [
            {"chunk": s.chunk, "s_i": s.s_i, "s_p": s.s_p, "total": s.total} for s in scores
        ]
        trace.selected = selected
        return Selection(request, scores, selected, trace, meter, bank, keys, position_scheme("causal"))

    def chunk_kv(
        self, chunks: Sequence[Sequence[int]], config: EngineConfig | None = None
    ) -> tuple[list[torch.Tensor], int]:
        """Step-3 KV of ``chunks`` in the config's prefill attention, from the store or computed (chunk-only).

        Returns the segments and how many came from the store."""
        cfg = config or self.config
        kv, stats = chunk_prefill(
            self.model, chunks, cfg.prefill_attention, cfg.chunk_size, cfg.prefill_batch, self.store
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
        return build_static(self.model, request, layout, config or self.config, local)

    def prefill(
        self, context: Ids, question: Ids, gen: GenerationConfig, instruction: Ids | None = None
    ) -> PrefillResult:
        """Steps 3-6: chunk prefill, scoring, top-K (+top-B) selection and the static decode KV."""
        cfg = self.config
        sel = self.select(context, question, gen, instruction)
        request, selected, trace = sel.request, sel.selected, sel.trace
        layout = decode_layout(request, selected, gen.gen_length)
        with trace.phase("build", self.device):
            local: list[torch.Tensor] = []
            if cfg.kv_mode == "chunk-only" and cfg.prefill_attention == "causal":
                local = [sel.bank.segment(i) for i in selected]  # type: ignore[union-attr]
            elif cfg.kv_mode == "chunk-only":
                local, hits = self.chunk_kv([request.chunks[i] for i in selected], cfg)
                trace.cache_hits += hits
                trace.cache_misses += len(selected) - hits
            static = self.build(request, layout, cfg, local)
        sel.bank = None
        trace.kept_tokens = static.kept_tokens
        return PrefillResult(request, layout, static, sel.scores, selected, trace, sel.meter)

    def decode(
        self,
        prefilled: PrefillResult,
        gen: GenerationConfig,
        policy: DecodePolicy | None = None,
        progress: bool = False,
    ) -> GenerationResult:
        """Step 7 over the static KV of ``prefilled``; fills the decode fields of its trace."""
        trace, device = prefilled.trace, self.device
        policy = policy or StaticPolicy(self.decode_attention)
        with trace.phase("decode", device):
            result = decode(
                self.model,
                prefilled.request.query,
                prefilled.static,
                gen,
                policy,
                progress,
                self.cuda_graph,
                self.graph_cache,
            )
        trace.decode_steps = result.steps
        trace.peak_memory_bytes, trace.memory_kind = prefilled.meter.peak()
        result.timings = dict(trace.timings)
        return result

    def generate(
        self,
        context_ids: Ids,
        question_ids: Ids,
        gen: GenerationConfig,
        instruction_ids: Ids | None = None,
        progress: bool = False,
    ) -> tuple[GenerationResult, Trace]:
        prefilled = self.prefill(context_ids, question_ids, gen, instruction_ids)
        result = self.decode(prefilled, gen, progress=progress)
        return result, prefilled.trace
