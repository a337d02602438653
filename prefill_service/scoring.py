"""Step 4, fast path: score every chunk from its banked causal KV, batched over chunks.

Equal to :func:`reference.reference_scores` (see its docstring for the conventions), computed without
re-encoding any chunk: the pseudo-label draft forwards only ``query window + labels`` per chunk over the
chunk's full KV; the NLL forward forwards ``[last chunk token, query window, labels]`` causally over the
chunk's KV without its last token, so the state that predicts the first query token is recomputed exactly
(that one token is cheaper than carrying hidden states through the chunk store).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdllm.prefill_service.attention import KEY_MULTIPLE, BankPrefixAttention
from pdllm.shared.chunk_prefill import ChunkBank, PrefillStopped
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.device_sampler import to_device, unmask_window
from pdllm.shared.generation.sampler import greedy_predictions, step_schedule
from pdllm.shared.layout import Request
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.reference import ChunkScore, draft_config
from pdllm.shared.stepwise import Steps, drain

# A scoring group attends to at most this many chunk tokens: ``prefill_batch`` chunks of the default 1024
# (unchanged), fewer of longer ones, so that one group stays short whatever chunk size a request asks for
# (64 chunks of 16K: 1.0-1.6 s on the tiny model on a 2-core CPU; 4 of them: 0.05 s).
SCORE_GROUP_TOKENS = 64 * 1024


def score_tail(request: Request, config: EngineConfig, width: int) -> int:
    """Free bank slots after rows of ``width`` tokens that scoring's forwards use in place
    (:class:`BankPrefixAttention`): its longest local block (the NLL forward's last chunk token, query
    window and labels), plus what makes a row's keys a multiple of ``KEY_MULTIPLE``."""
    window = config.scoring_window()
    q = len(request.query[-window:] if window else request.query)
    labels = config.pseudo_labels if config.score_mode == "pseudo-label" else 0
    tail = 1 + q + labels
    return tail + -(width + tail) % KEY_MULTIPLE


def score_chunks(
    model: DiffusionLM, request: Request, config: EngineConfig, bank: ChunkBank
) -> list[ChunkScore]:
    return drain(score_chunks_steps(model, request, config, bank))


def score_chunks_steps(
    model: DiffusionLM,
    request: Request,
    config: EngineConfig,
    bank: ChunkBank,
    stop: Callable[[], bool] | None = None,
) -> Steps[list[ChunkScore]]:
    """:func:`score_chunks` in groups of chunks (at most ``prefill_batch``, and ``SCORE_GROUP_TOKENS``
    chunk tokens), yielding after each but the last. ``stop`` is asked before every group; True raises
    :class:`PrefillStopped`."""
    window = config.scoring_window()
    query = request.query[-window:] if window else request.query
    size = max(1, min(config.prefill_batch, SCORE_GROUP_TOKENS // config.chunk_size))
    out: list[ChunkScore] = []
    for a in range(0, request.num_chunks, size):
        if stop is not None and stop():
            raise PrefillStopped(f"stopped after scoring {a} of {request.num_chunks} chunks")
        with torch.inference_mode():
            out += _score_group(
                model, request, config, bank, slice(a, min(a + size, request.num_chunks)), query
            )
        if a + size < request.num_chunks:
            yield
    return out


def _score_group(
    model: DiffusionLM, request: Request, config: EngineConfig, bank: ChunkBank, rows: slice, query: list[int]
) -> list[ChunkScore]:
    device = bank.kv.device
    # host lists reach the device through pinned copies: a pageable copy would wait for queued kernels
    lens = to_device(bank.lens[rows], torch.long, device)
    n, width, q = lens.shape[0], max(bank.lens[rows]), len(query)
    span = torch.arange(width, device=device)
    query_t = to_device(query, torch.long, device)
    labels = torch.empty(n, 0, dtype=torch.long, device=device)
    pseudo = config.score_mode == "pseudo-label"
    if pseudo:
        labels = _draft(model, config, bank, rows, lens, span, query_t)
    last = to_device([request.chunks[i][-1] for i in range(rows.start, rows.stop)], torch.long, device)
    tokens = torch.cat([last[:, None], query_t.expand(n, -1), labels], dim=1)
    positions = lens[:, None] - 1 + torch.arange(tokens.shape[1], device=device)
    attention = BankPrefixAttention(bank, rows, span[None] < (lens[:, None] - 1), local_causal=True)
    hidden = model.hidden_states(tokens, positions, attention)
    logits = model.lm_head(hidden[:, :-1]).float()
    token_nll = -torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    s_i = token_nll[:, :q].mean(dim=1).tolist()
    s_p = token_nll[:, q:].mean(dim=1).tolist() if pseudo else [None] * n
    label_lists = labels.tolist()
    return [
        ChunkScore(chunk=rows.start + j, s_i=s_i[j], s_p=s_p[j], labels=label_lists[j] if pseudo else [])
        for j in range(n)
    ]


def _draft(
    model: DiffusionLM,
    config: EngineConfig,
    bank: ChunkBank,
    rows: slice,
    lens: torch.Tensor,
    span: torch.Tensor,
    query: torch.Tensor,
) -> torch.Tensor:
    """Pseudo-labels per chunk: greedy denoising of ``p`` [MASK] slots after the query, all chunks at once.

    The unmasking is :class:`~pdllm.shared.generation.sampler.DenoiseState`'s decision for the draft config
    (one block, greedy, no EOS stop: every chunk follows the same schedule) made on the device for every
    chunk together (:func:`~pdllm.shared.generation.device_sampler.unmask_window`), so the rounds run with
    no host sync and no per-chunk Python; the reference unmasks chunk by chunk (``reference_scores``)."""
    device = lens.device
    n, q, p = lens.shape[0], query.shape[0], config.pseudo_labels
    mask_id = model.config.mask_token_id
    gen = draft_config(config)
    if gen.temperature != 0 or gen.threshold is not None or gen.num_blocks != 1:
        raise ValueError("the pseudo-label draft is greedy over one block on a fixed schedule")
    tokens = torch.cat([query.expand(n, -1), torch.full((n, p), mask_id, device=device)], dim=1)
    positions = lens[:, None] + torch.arange(q + p, device=device)
    attention = BankPrefixAttention(bank, rows, span[None] < lens[:, None], local_causal=False)
    label_rows = (q + torch.arange(p, device=device)).expand(n, -1)
    no_threshold = torch.zeros(n, dtype=torch.float32, device=device)
    by_schedule = torch.zeros(n, dtype=torch.bool, device=device)
    for k in step_schedule(p, gen.steps):  # sums to p: the last step unmasks what is left, as the reference
        hidden = model.hidden_states(tokens, positions, attention)
        logits = model.logits_from_hidden(hidden, label_rows)
        confidence, predicted = greedy_predictions(logits.reshape(n * p, -1), mask_id)
        ks = torch.full((n,), k, dtype=torch.long, device=device)
        window = unmask_window(
            tokens[:, q:], confidence.view(n, p), predicted.view(n, p), ks, no_threshold, by_schedule, mask_id
        )
        tokens[:, q:] = window
    return tokens[:, q:]
