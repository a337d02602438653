"""Steps 3-5 of one model, what ``pdllm.v1.Prefill`` serves: chunk prefill, scoring, top-K selection.

:class:`PrefillWorker` turns a request into a validated :class:`PrefillJob` (chunk layout from
``shared/layout.py``) and runs jobs in batches (:meth:`PrefillWorker.prefill_many`): the chunks of every
job are prefilled together (``shared/chunk_prefill.py``; chunks found in the chunk store are not
forwarded), then each job is scored (``scoring.py``) and its top-K chunks selected on its own. Only then
is chunk KV written to the store, what the worker's write policy keeps of it (``shared/kv_write_policy.py``,
default "second-sight"): scoring reads every chunk's KV anyway, so waiting for the selection holds nothing
longer, and the store (a background writer under ``serve``) copies only what will be written. The result,
a :class:`Selection`, is what the prefill server answers with (as handles: chunk store keys and token ids)
and what the in-process engine (``pdllm.shared.app.engine``) hands to its decode phase.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

import torch

from pdllm.prefill_service.handoff import DecodeKVBuild, HandoffKV, handoff_kv
from pdllm.prefill_service.scoring import score_chunks_steps, score_tail
from pdllm.prefill_service.trace import MemoryMeter, Trace
from pdllm.shared.chunk_prefill import ChunkBank, PrefillStopped, chunk_prefill_steps
from pdllm.shared.chunk_store import ChunkKVStore, chunk_keys, position_scheme
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_write_policy import (
    DEFAULT_KV_WRITE_POLICY,
    KVWritePolicy,
    check_kv_write_policy,
    chunks_to_write,
)
from pdllm.shared.layout import Request, make_request, select_top_k, sentence_end_ids
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.reference import ChunkScore
from pdllm.shared.stepwise import Steps, drain

Ids = Sequence[int] | torch.Tensor | str


@dataclass
class Selection:
    """Steps 3-5 of one request (``keys``: the chunk store keys of every chunk's step-3 KV; ``bank``: that
    KV in memory until the in-process engine's decode phase releases it, None for a job that does not keep
    it; ``config``: the job's settings)."""

    request: Request
    scores: list[ChunkScore]
    selected: list[int]
    trace: Trace
    meter: MemoryMeter
    bank: ChunkBank | None
    keys: list[str]
    position_scheme: str
    config: EngineConfig
    handoff: HandoffKV | None = None  # KV to hand to the decode worker (the job asked for it)


class PrefillCancelled(CancelledError):
    """A job whose caller went away (cancelled, or past its deadline) before its prefill finished."""


@dataclass(frozen=True)
class PrefillJob:
    """A validated request waiting for steps 3-5 (see :meth:`PrefillWorker.prefill_many`). ``cancelled``:
    set when its caller is gone; the worker then stops its work between forwards."""

    request: Request
    gen: GenerationConfig
    config: EngineConfig
    cancelled: threading.Event | None = field(default=None, compare=False)
    offer_handoff: bool = False  # also make the KV a decode worker can pull (``handoff.py``)
    # The selection keeps its step-3 KV (the in-process engine's decode reads it). A server answers with
    # handles, so it lets the KV go once written and handed off instead of holding it until it replies.
    keep_bank: bool = True

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled is not None and self.cancelled.is_set()

    @property
    def num_context_tokens(self) -> int:
        return sum(len(c) - 1 for c in self.request.chunks)


class PrefillWorker:
    """``config``: the default settings of a job (a job may carry its own). ``store``: where step-3 chunk KV
    is published and reused across requests (None: no reuse). ``sentence_ends``: token ids that end a
    sentence, for ``chunk_boundary="sentence"`` (None: computed once from the tokenizer when first needed).
    ``decode_kv_build``: the decode worker's KV build, for jobs that offer a handoff (None: only chunk-only
    jobs can offer one). ``kv_write_policy``: which computed chunks' KV is written to ``store`` after
    selection (``shared/kv_write_policy.py``).
    """

    def __init__(
        self,
        model: DiffusionLM,
        tokenizer: Any | None = None,
        config: EngineConfig | None = None,
        store: ChunkKVStore | None = None,
        sentence_ends: Collection[int] | None = None,
        decode_kv_build: DecodeKVBuild | None = None,
        kv_write_policy: KVWritePolicy = DEFAULT_KV_WRITE_POLICY,
    ) -> None:
        self.model = model
        self.kv_write_policy = check_kv_write_policy(kv_write_policy)
        self.decode_kv_build = decode_kv_build
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.config.validate()
        self.store = store
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

    def prefill(
        self,
        context: Ids,
        question: Ids,
        gen: GenerationConfig,
        instruction: Ids | None = None,
        config: EngineConfig | None = None,
    ) -> Selection:
        """Steps 3-5 of one request: chunk prefill, scoring, top-K selection."""
        out = self.prefill_many([self.job(context, question, gen, instruction, config)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def job(
        self,
        context: Ids,
        question: Ids,
        gen: GenerationConfig,
        instruction: Ids | None = None,
        config: EngineConfig | None = None,
    ) -> PrefillJob:
        """One validated request for :meth:`prefill_many` (ValueError on bad input)."""
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
        return PrefillJob(request, gen, cfg)

    def prefill_many(
        self, jobs: Sequence[PrefillJob], max_tokens: int | None = None
    ) -> list[Selection | Exception]:
        """Steps 3-5 for several requests at once: the chunks of all requests that share a chunk size are
        prefilled in the same batched forwards (a chunk two requests share is forwarded once; at most
        ``max_tokens`` padded tokens each, when given), then every request is scored and selected on its
        own. Results equal :meth:`prefill` on each request alone; a job's bad input gives its ValueError, a
        cancelled job :class:`PrefillCancelled`."""
        return drain(self.prefill_many_steps(jobs, max_tokens))

    def prefill_many_steps(
        self, jobs: Sequence[PrefillJob], max_tokens: int | None = None, hand_over: bool = False
    ) -> Steps[list[Selection | Exception]]:
        """:meth:`prefill_many` in pieces: yields after every chunk-prefill forward (at most ``max_tokens``
        padded tokens each, when given) and after every scoring group (``scoring.py``); same results.
        ``hand_over``: yields each chunk-prefill forward to the driver to run instead (``ChunkForward``). A
        group whose jobs are all cancelled stops before its next forward; a cancelled job stops being
        scored before its next scoring group (and builds no handoff KV)."""
        out: list[Selection | Exception] = [ValueError("not run")] * len(jobs)
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
            width = max(len(c) for c in chunks)  # the bank's rows, before the scoring slots after them
            everyone_gone = lambda m=members: all(jobs[j].is_cancelled for j in m)  # noqa: E731
            try:
                # event-timed: scoring's launches queue behind the prefill's kernels instead of waiting
                # (includes the time others ran between pieces)
                with timer.phase("prefill", self.device, sync=False):
                    bank, stats = yield from chunk_prefill_steps(
                        self.model, chunks, "causal", chunk_size, batch, self.store, keys, max_tokens,
                        stop=everyone_gone, hand_over=hand_over,
                        publish=False,  # written below, once each job's top-K is known
                        tail=max(score_tail(jobs[j].request, jobs[j].config, width) for j in members),
                    )  # fmt: skip
            except PrefillStopped as stopped:
                for j in members:
                    out[j] = PrefillCancelled(f"prefill cancelled by its caller ({stopped})")
                continue
            hit = set(stats.hit_rows)
            written: set[int] = set()  # bank rows handed to the store (a chunk two jobs share goes once)
            for j, idx in zip(members, rows):
                if jobs[j].is_cancelled:
                    out[j] = PrefillCancelled("prefill cancelled by its caller before scoring")
                    continue
                request = jobs[j].request
                trace = Trace(num_chunks=request.num_chunks, context_tokens=jobs[j].num_context_tokens)
                trace.adopt(timer, "prefill")
                trace.cache_hits = sum(i in hit for i in idx)
                trace.cache_misses = len(idx) - trace.cache_hits
                trace.prefill_skipped = trace.cache_misses == 0  # all its chunks came from the store
                try:
                    sel = yield from self._score_select(
                        jobs[j], trace, meter, bank.take(idx), [keys[i] for i in idx]
                    )
                except PrefillStopped as stopped:
                    out[j] = PrefillCancelled(f"prefill cancelled by its caller during scoring ({stopped})")
                    continue
                except ValueError as exc:  # one request's problem is not its batch-mates'
                    out[j] = exc
                else:
                    self._write_chunks(sel, bank, keys, idx, hit, written)
                    if not jobs[j].keep_bank:
                        sel.bank = None
                    out[j] = sel
                yield
            del bank  # the next group's prefill must not find this one's KV still referenced
        return out

    def _write_chunks(
        self,
        sel: Selection,
        bank: ChunkBank,
        keys: list[str],
        rows: list[int],
        hit: set[int],
        written: set[int],
    ) -> None:
        """Hands the KV the write policy keeps of ``sel``'s computed chunks to the store. ``rows``: the
        request's chunks' rows in the group ``bank`` / ``keys``; ``hit``: rows found in the store. Under
        ``serve`` the store is a background writer: it copies each value on the device and returns, and
        its own thread moves the copies to the tiers (so the device thread never waits for Redis)."""
        if self.store is None:
            return
        computed = [c for c, row in enumerate(rows) if row not in hit]
        chosen = chunks_to_write(self.kv_write_policy, computed, sel.selected, sel.trace.cache_hits > 0)
        # The top-K first: the writer is FIFO, and a chunk-only decode worker reads those next.
        chosen.sort(key=lambda c: c not in sel.selected)
        todo = list(dict.fromkeys(rows[c] for c in chosen if rows[c] not in written))
        if not todo:
            return
        written.update(todo)
        sel.trace.chunks_written = self.store.put_many([(keys[r], bank.segment(r)) for r in todo])

    def _score_select(
        self, job: PrefillJob, trace: Trace, meter: MemoryMeter, bank: ChunkBank, keys: list[str]
    ) -> Steps[Selection]:
        """Steps 4-5 of ``job``, in scoring groups; PrefillStopped once its caller has gone."""
        model, device, cfg, request = self.model, self.device, job.config, job.request
        stop = lambda: job.is_cancelled  # noqa: E731
        with trace.phase("score", device, sync=False):  # (includes the time others ran between groups)
            scores = yield from score_chunks_steps(model, request, cfg, bank, stop)
        with trace.phase("select", device):
            selected = select_top_k([s.total for s in scores], cfg.top_k)
        trace.chunk_scores = [
            {"chunk": s.chunk, "s_i": s.s_i, "s_p": s.s_p, "total": s.total} for s in scores
        ]
        trace.selected = selected
        sel = Selection(request, scores, selected, trace, meter, bank, keys, position_scheme("causal"), cfg)
        if job.offer_handoff:
            if stop():
                raise PrefillStopped("stopped before the handoff build")
            with trace.phase("handoff_build", device):
                sel.handoff = handoff_kv(request, selected, bank.segment, job.gen, cfg, self.decode_kv_build)
        return sel
