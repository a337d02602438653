"""Several requests decoded together under FOCUS's fast path (``focus_fast.FocusBatch``).

:class:`FocusDecodeBatch` holds a batch of requests of one model and one generation config and advances
every unfinished one by a step per :meth:`~FocusDecodeBatch.step`: one packed FOCUS forward for all of
them, then the shared sampler (``predict_many``: one read of all predictions, each request's
``DenoiseState`` choosing among its eligible rows). Requests are

- Dream/LLaDA (:meth:`FocusDecodeBatch.local`): local rows (vanilla: prompt + response; pdllm: query
  suffix + response) over the method's backend ``inner``, blocks of ``denoise``'s schedule;
- SDAR (:meth:`FocusDecodeBatch.block_diffusion`): prefilled into an exact cache of whole blocks like
  ``generate_block_diffusion``, each block's window denoised over it and recorded once finished.

The sampler states live on the host (their tokens are copied to the model's device once per step), so
FOCUS's step reads the device once (its selection) and the sampler once (its predictions). Each request's
tokens equal its reference run (``focus_reference``) token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pdllm.decode_service.block_diffusion import (
    PREFILL_PIECE_TOKENS,
    BlockKVCache,
    answer_spans,
    check_prefix,
    generation_block,
    prefill_blocks,
    record_span,
)
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, predict_many
from pdllm.shared.model.attention import AttentionBackend, DenseAttention
from pdllm.shared.model.transformer import DiffusionLM

from .focus import FocusConfig, FocusMemory, FocusStats, check_model
from .focus_fast import FocusBatch, FocusRequest
from .focus_layers import RowsAttention, SdarRows, inner_rows


@dataclass
class BatchedRequest:
    """One request's place: ``seq`` (device) holds its rows, the response from ``response_start``; SDAR
    requests also their cache (the window starts at ``cache.length``)."""

    state: DenoiseState
    seq: torch.Tensor
    positions: torch.Tensor
    response_start: int
    slot: int
    inner: AttentionBackend | None = None
    cache: BlockKVCache | None = None
    memory: FocusMemory = field(default_factory=FocusMemory)
    stats: FocusStats = field(default_factory=FocusStats)


class FocusDecodeBatch:
    """Requests of one model under FOCUS, stepped together; add them, then :meth:`run` (or :meth:`step`)."""

    def __init__(self, model: DiffusionLM, gen: GenerationConfig, focus: FocusConfig, slots: int) -> None:
        gen.validate()
        self.model, self.gen, self.focus = model, gen, focus
        self.sdar = model.config.block_size is not None
        check_model(model, block_diffusion=self.sdar)
        self.block = generation_block(gen, model.config.block_size) if self.sdar else gen.block
        self.batch = FocusBatch(model, focus, self.block, slots)
        self.requests: list[BatchedRequest] = []
        self.free = list(range(slots))  # block-K/V slots no request holds
        self.seconds = 0.0

    @property
    def full(self) -> bool:
        return not self.free

    def _state(self, spans: list[tuple[int, int]] | None = None) -> DenoiseState:
        if self.full:
            raise ValueError(f"the batch holds {len(self.requests)} requests, all its slots")
        cfg = self.model.config
        return DenoiseState(self.gen, cfg.mask_token_id, cfg.eos_token_id, "cpu", spans)

    def _add(self, req: BatchedRequest) -> BatchedRequest:
        self.free.remove(req.slot)
        self.requests.append(req)
        return req

    def remove(self, req: BatchedRequest) -> None:
        """Drop ``req`` (finished or abandoned): it is stepped no more and its slot is free again."""
        self.requests.remove(req)
        self.free.append(req.slot)

    def local(
        self, local: torch.Tensor, positions: torch.Tensor, response_start: int, inner: AttentionBackend
    ) -> BatchedRequest:
        """Add a Dream/LLaDA request: ``local`` ``[N]`` rows (the response last), ``positions`` ``[N]``."""
        if self.sdar:
            raise ValueError("SDAR requests are added with block_diffusion(prompt)")
        if response_start != local.numel() - self.gen.gen_length or response_start < 1:
            raise ValueError("the response must be the last gen_length local rows, after at least one row")
        return self._add(
            BatchedRequest(self._state(), local, positions, response_start, self.free[0], inner=inner)
        )

    @torch.inference_mode()  # its prefill's K/V are kept: without it they would hold their autograd graph
    def block_diffusion(self, prompt: torch.Tensor, prefix: BlockKVCache | None = None) -> BatchedRequest:
        """Add an SDAR request and prefill its prompt's whole generation blocks into its exact cache,
        continuing ``prefix`` when given (pdllm's block-causal cache of its static part, ``sdar_decode``)."""
        if not self.sdar:
            raise ValueError(f"{self.model.config.family!r} requests are added with local(...)")
        p, block = prompt.numel(), self.block
        state = self._state(answer_spans(p, self.gen.gen_length, block))
        seq = torch.cat([prompt, state.tokens.to(prompt.device)])
        model_block = self.model.config.block_size
        assert model_block is not None
        cache = BlockKVCache(seq.numel(), model_block) if prefix is None else prefix
        cached = p // block * block
        check_prefix(cache, seq.numel(), model_block, cached)
        # as BlockDiffusionSession prefills (the same pieces, so the same K/V)
        prefill_blocks(self.model, cache, seq, cached, max(block, PREFILL_PIECE_TOKENS // block * block))
        positions = torch.arange(seq.numel(), device=seq.device)
        return self._add(BatchedRequest(state, seq, positions, p, self.free[0], cache=cache))

    def _window(self, req: BatchedRequest) -> tuple[int, int, int, list[bool], RowsAttention]:
        """The step's rows of ``req``: (first local row, block rows [lo, hi) in them, masked block rows,
        attention)."""
        state, rs = req.state, req.response_start
        a, b = state.spans[state.block]
        req.seq[rs:] = state.tokens.to(req.seq.device)  # the response so far (earlier blocks included)
        masked = (state.tokens[a:b] == state.mask_id).tolist()
        if req.cache is None:
            assert req.inner is not None
            return 0, rs + a, rs + b, masked, inner_rows(req.inner)
        start = req.cache.length  # SDAR: the window from the end of the cache (it may hold prompt rows)
        masked = [False] * (rs + a - start) + masked
        assert self.model.config.block_size is not None
        attention = SdarRows(req.cache, req.positions[start : rs + b], self.model.config.block_size)
        return start, 0, rs + b - start, masked, attention

    @torch.inference_mode()
    def step(self) -> None:
        """One step of every unfinished request."""
        begin = time.perf_counter()
        live = [r for r in self.requests if not r.state.done]
        reqs, starts = [], []
        for req in live:
            start, lo, hi, masked, attention = self._window(req)
            # SDAR's window ends with its block; Dream/LLaDA forward every local row
            end = (
                req.response_start + req.state.spans[req.state.block][1]
                if req.cache is not None
                else req.seq.numel()
            )
            at = (req.state.positions() + (req.response_start - start)).tolist()
            q = FocusRequest(
                req.slot, req.seq[start:end], req.positions[start:end], lo, hi, at, attention,
                req.state.quota(), req.memory, req.stats,
            )  # fmt: skip
            self.batch.start(q, req.state.block, masked)
            reqs.append(q)
            starts.append(start)
        outs = self.batch.step(reqs)
        logits = torch.cat([out[0] for out in outs])
        preds = predict_many(logits, [r.state for r in live], [len(q.at) for q in reqs])
        for req, q, (tokens, conf), (_, eligible), start in zip(live, reqs, preds, outs, starts, strict=True):
            state = req.state
            block = state.block
            picked = state.apply(tokens, conf, eligible)
            self.batch.observe(q, (picked + (req.response_start - start) - q.lo).tolist())
            if req.cache is not None and state.block != block and not state.done:
                req.seq[req.response_start :] = state.tokens.to(req.seq.device)
                end = req.response_start + state.spans[block][1]
                record_span(self.model, req.cache, req.seq, start, end)  # the finished block's exact K/V
        self.seconds += time.perf_counter() - begin

    def run(self) -> list[GenerationResult]:
        """Step until every request is done; their results (``cache``: FOCUS's counters), in order."""
        while any(not r.state.done for r in self.requests):
            self.step()
        return [self.result(r) for r in self.requests]

    def result(self, req: BatchedRequest, seconds: float | None = None) -> GenerationResult:
        """``req``'s result; ``decode_seconds``: ``seconds``, else the batch's stepping time."""
        return GenerationResult(
            token_ids=req.state.result(),
            raw_tokens=req.state.tokens.tolist(),
            steps=req.state.steps_taken,
            decode_seconds=self.seconds if seconds is None else seconds,
            cache={"policy": self.focus.name, **req.stats.as_dict()},
        )


@torch.inference_mode()
def generate_focus_batched(
    model: DiffusionLM, prompts: list[list[int]], gen: GenerationConfig, focus: FocusConfig
) -> list[GenerationResult]:
    """Vanilla generation of several prompts under FOCUS's fast path: SDAR block by block over its exact
    cache, Dream/LLaDA over prompt + response with dense attention."""
    batch = FocusDecodeBatch(model, gen, focus, len(prompts))
    device = next(model.parameters()).device
    for ids in prompts:
        prompt = torch.as_tensor(ids, dtype=torch.long, device=device)
        if batch.sdar:
            batch.block_diffusion(prompt)
        else:
            local = torch.cat(
                [prompt, torch.full((gen.gen_length,), model.config.mask_token_id, device=device)]
            )
            batch.local(local, torch.arange(local.numel(), device=device), prompt.numel(), DenseAttention())
    return batch.run()
