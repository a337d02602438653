"""The reference path: the specification of Prefilling-dLLM, written as plainly as possible.

Every phase builds its explicit token sequence, position ids and boolean attention mask and runs the
model's full forward through :class:`DenseAttention`; nothing is cached. Decoding re-runs the KV build
inside every step's forward (the build tokens and the decode tokens share one sequence; a block mask keeps
the decode tokens from being seen by the build tokens), so "static KV" is never stored, only recomputed.
The fast path (``shared/chunk_prefill.py``, ``prefill_service``, ``decode_service``) must agree with this
token-for-token; ``tests/engine`` checks it.

Scoring conventions (shared with the fast path):
- NLLs use the autoregressive reading of a causal forward for both families: token ``t_p`` is scored by the
  LM head applied to the hidden state at ``p - 1`` (Dream's own logit shift; for LLaDA the same reading,
  because under causal attention the state at ``p`` has already seen ``t_p``).
- Pseudo-labels are drafted with the shared sampler (:class:`DenoiseState`, greedy, ``pseudo_rounds``
  steps over ``pseudo_labels`` masked tokens, no EOS stop); during drafting the query and labels attend to
  the chunk and to each other bidirectionally while the chunk only sees itself (as in its prefill).
- Top-B retention score of chunk token ``j``: summed over layers and query heads of the build forward,
  ``sum_k A[q_k, j] + sum_k A[j, q_k]`` over the query-suffix tokens ``q_k`` (softmax probabilities of the
  full rows). ``chunk-only`` has no build forward: there the first decode forward's (all-masked response)
  ``A[q_k, j]`` is used; the chunk never attends to the query in that mode, so the second term is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, denoise
from pdllm.shared.layout import DecodeLayout, Request, decode_layout, keep_top_b, select_top_k
from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.model.transformer import DiffusionLM


@dataclass(frozen=True)
class ChunkScore:
    chunk: int
    s_i: float
    s_p: float | None
    labels: list[int]

    @property
    def total(self) -> float:
        return self.s_i + (self.s_p or 0.0)


@dataclass
class ReferenceOutput:
    result: GenerationResult
    scores: list[ChunkScore]
    selected: list[int]
    kept: list[torch.Tensor]  # per selected chunk: kept token indices within the chunk (BOS = 0)


def draft_config(config: EngineConfig) -> GenerationConfig:
    return GenerationConfig(
        gen_length=config.pseudo_labels, steps=config.pseudo_rounds, temperature=0.0, stop_at_eos=False
    )


def nll(model: DiffusionLM, hidden: torch.Tensor, tokens: torch.Tensor, start: int, end: int) -> float:
    """Mean NLL of ``tokens[start:end]``, each scored from the hidden state just before it."""
    logits = model.lm_head(hidden[start - 1 : end - 1]).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[start:end, None])
    return float(-logp.mean())


def _within_chunk(n: int, causal: bool, device: torch.device) -> torch.Tensor:
    full = torch.ones(n, n, dtype=torch.bool, device=device)
    return full.tril() if causal else full


@torch.inference_mode()
def reference_scores(model: DiffusionLM, request: Request, config: EngineConfig) -> list[ChunkScore]:
    device = next(model.parameters()).device
    window = config.scoring_window()
    query = request.query[-window:] if window else request.query
    pseudo = config.score_mode == "pseudo-label"
    out = []
    for i, chunk in enumerate(request.chunks):
        n, q = len(chunk), len(query)
        labels: list[int] = []
        if pseudo:
            p = config.pseudo_labels
            seq = torch.tensor(chunk + query + [model.config.mask_token_id] * p, device=device)
            mask = torch.ones(len(seq), len(seq), dtype=torch.bool, device=device)
            mask[:n] = False
            mask[:n, :n] = _within_chunk(n, True, device)
            state = DenoiseState(draft_config(config), model.config.mask_token_id, None, device)
            while not state.done:
                seq[n + q :] = state.tokens
                at = (state.positions() + n + q)[None]
                state.update(
                    model(seq[None], attention=DenseAttention(mask=mask[None, None]), logits_at=at)[0]
                )
            labels = state.tokens.tolist()
        tokens = torch.tensor(chunk + query + labels, device=device)
        hidden = model.hidden_states(tokens[None], attention=DenseAttention(causal=True))[0]
        s_i = nll(model, hidden, tokens, n, n + q)
        s_p = nll(model, hidden, tokens, n + q, n + q + len(labels)) if pseudo else None
        out.append(ChunkScore(chunk=i, s_i=s_i, s_p=s_p, labels=labels))
    return out


@dataclass(frozen=True)
class Sequence:
    """One explicit forward: tokens, positions, mask, and where the decode tokens sit."""

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor  # [T, T] bool, True = may attend
    decode_start: int  # index of the decode part's first query token
    build_query: slice | None  # the build part's query rows (for retention), None without a build part


def decode_sequence(
    request: Request, layout: DecodeLayout, config: EngineConfig, mask_id: int, device: torch.device
) -> Sequence:
    """Static tokens + (build query [+ masks]) + decode query + response, with the mode's block mask."""
    static = list(request.instruction)
    for i in layout.chunk_ids:
        static += request.chunks[i]
    s, q, g = layout.static_len, layout.query_len, layout.gen_length
    decode_part = request.query + [mask_id] * g
    if config.kv_mode == "full-mask":
        build = static + request.query + [mask_id] * g
    elif config.kv_mode == "chunk-query":
        build = static + request.query
    else:
        build = static
    tokens = torch.tensor(build + decode_part, device=device)
    nb, total = len(build), len(build) + q + g
    positions = torch.cat([torch.arange(nb), torch.arange(s, s + q + g)]).to(device)
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    if config.kv_mode == "chunk-only":
        blocks = [(0, layout.instruction_len, False)]
        blocks += [
            (a, a + n, config.prefill_attention == "causal")
            for a, n in zip(layout.chunk_starts, layout.chunk_lens, strict=True)
        ]
        for a, b, causal in blocks:
            mask[a:b, a:b] = _within_chunk(b - a, causal, device)
    else:
        mask[:nb, :nb] = True
    mask[nb:, :s] = True
    mask[nb:, nb:] = True
    build_query = slice(s, s + q) if config.kv_mode != "chunk-only" else None
    return Sequence(tokens, positions, mask, nb, build_query)


class _ProbeAttention:
    """Explicit softmax attention that also accumulates query<->key probability mass per key."""

    def __init__(self, mask: torch.Tensor, query_rows: slice, both_directions: bool) -> None:
        self.mask = mask
        self.rows = query_rows
        self.both = both_directions
        self.mass = torch.zeros(mask.shape[-1], dtype=torch.float64, device=mask.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        logits = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
        probs = torch.softmax(logits.masked_fill(~self.mask, float("-inf")), dim=-1)
        self.mass += probs[0, :, self.rows, :].sum(dim=(0, 1))
        if self.both:
            self.mass += probs[0, :, :, self.rows].sum(dim=(0, 2))
        return (probs @ v.double()).to(q.dtype)


def reference_retention(
    model: DiffusionLM, request: Request, layout: DecodeLayout, config: EngineConfig
) -> list[torch.Tensor]:
    """Kept token indices per selected chunk (all of them when top-B is off)."""
    device = next(model.parameters()).device
    if config.top_b is None:
        return [torch.arange(n, device=device) for n in layout.chunk_lens]
    seq = decode_sequence(request, layout, config, model.config.mask_token_id, device)
    if seq.build_query is not None:
        nb = seq.decode_start
        tokens, positions, mask, rows = (
            seq.tokens[:nb],
            seq.positions[:nb],
            seq.mask[:nb, :nb],
            seq.build_query,
        )
        both = config.retention_score == "bidirectional"
    else:
        tokens, positions, mask = seq.tokens, seq.positions, seq.mask
        rows, both = slice(seq.decode_start, seq.decode_start + layout.query_len), False
    probe = _ProbeAttention(mask[None, None], rows, both)
    model.hidden_states(tokens[None], positions[None], attention=probe)
    return [
        keep_top_b(probe.mass[a : a + n], config.top_b)
        for a, n in zip(layout.chunk_starts, layout.chunk_lens, strict=True)
    ]


@torch.inference_mode()
def reference_generate(
    model: DiffusionLM, request: Request, config: EngineConfig, gen: GenerationConfig
) -> ReferenceOutput:
    device = next(model.parameters()).device
    scores = reference_scores(model, request, config)
    selected = select_top_k([s.total for s in scores], config.top_k)
    layout = decode_layout(request, selected, gen.gen_length)
    kept = reference_retention(model, request, layout, config)
    seq = decode_sequence(request, layout, config, model.config.mask_token_id, device)
    mask = seq.mask.clone()
    for a, n, keep in zip(layout.chunk_starts, layout.chunk_lens, kept, strict=True):
        dropped = torch.ones(n, dtype=torch.bool, device=device)
        dropped[keep] = False
        mask[seq.decode_start :, a : a + n] &= ~dropped
    tokens = seq.tokens.clone()
    response_start = seq.decode_start + layout.query_len
    attention = DenseAttention(mask=mask[None, None])

    def logits_fn(response: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens[response_start:] = response
        return model(
            tokens[None], seq.positions[None], attention, logits_at=(positions + response_start)[None]
        )[0]

    result = denoise(gen, model.config.mask_token_id, model.config.eos_token_id, logits_fn, device=device)
    return ReferenceOutput(result=result, scores=scores, selected=selected, kept=kept)
