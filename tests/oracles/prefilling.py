"""Oracle of Prefilling-dLLM's prefill side (``/work/shared/papers/prefilling-dllm.txt`` §3) and of the
static chunk KV a pdllm decode attends to.

- **Chunks**: the context cut every C tokens, a BOS before each chunk.
- **Pseudo-labels** (§3.1): ``[c_i; q; m]`` with p [MASK] slots ``m``, denoised greedily in ``rounds``
  forwards (the project's documented reading of the paper's "partial denoising rounds": the p slots split
  as evenly as possible over the rounds, earlier rounds taking the remainder, the last round unmasking what
  is left; the most confident predictions first, ties to the earlier slot, [MASK] never predicted). The
  chunk rows see only the chunk, causally (its prefill); the query and label rows see everything.
- **Scores** (eqs. 3-4): one causal forward over ``[c_i; q; m]``; ``s_I`` the mean NLL of the query
  tokens, ``s_P`` that of the labels, each token read from the hidden state just before it (the
  autoregressive reading, both families). Self-information scoring has no labels and ``s_P`` = None.
- **Selection**: the K chunks of lowest ``s_I + s_P`` (ties: the earlier chunk), in document order.
- **Static KV** (``full-mask``): one bidirectional forward of ``[instruction; selected chunks; q; masks]``
  at positions 0.. ; the K/V of the instruction and chunk rows, per layer. The decode's query suffix and
  response then sit at the positions right after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .plain import Static, Step, unmask


def chunks(context: list[int], size: int, bos: int) -> list[list[int]]:
    return [[bos, *context[i : i + size]] for i in range(0, len(context), size)]


class _Draft:
    """The draft's logits over ``[chunk; query; labels]`` with the chunk causal and alone."""

    def __init__(self, model, chunk: list[int], query: list[int], labels: int) -> None:
        self.model = model
        self.n, self.q = len(chunk), len(query)
        mask = model.config.mask_token_id
        self.seq = torch.tensor(chunk + query + [mask] * labels)
        t = self.seq.numel()
        allow = torch.ones(t, t, dtype=torch.bool)
        allow[: self.n, self.n :] = False
        allow[: self.n, : self.n] = torch.ones(self.n, self.n, dtype=torch.bool).tril()
        self.allow = allow

    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, None]:
        start = self.n + self.q
        self.seq[start:] = response
        allow = self.allow

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allow, enable_gqa=q.shape[1] != k.shape[1]
            )

        positions = torch.arange(self.seq.numel())[None]
        hidden = self.model.hidden_states(self.seq[None], positions, attention)[0]
        lead = 1 if self.model.config.shift_logits else 0
        rows = [start + j - lead for j in step.masked]
        return self.model.lm_head(hidden[rows]), None

    def observe(self, step: Step, picked: list[int]) -> None:
        pass


@torch.inference_mode()
def draft_labels(model, chunk: list[int], query: list[int], labels: int, rounds: int) -> list[int]:
    """The chunk's pseudo-labels: ``labels`` slots denoised in ``rounds`` forwards (one block)."""
    tokens, taken = unmask(
        model.config.mask_token_id, labels, labels, rounds, None, _Draft(model, chunk, query, labels)
    )
    assert taken == min(rounds, labels)
    return tokens


@torch.inference_mode()
def nll_scores(model, chunk: list[int], query: list[int], labels: list[int]) -> tuple[float, float | None]:
    """(s_I, s_P) of one chunk: mean NLLs of the query and of the labels under a causal forward."""
    tokens = torch.tensor(chunk + query + labels)
    t = tokens.numel()
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=q.shape[1] != k.shape[1])

    hidden = model.hidden_states(tokens[None], torch.arange(t)[None], attention)[0]
    logp = torch.log_softmax(model.lm_head(hidden[:-1]).float(), dim=-1)
    token_logp = logp.gather(-1, tokens[1:, None])[:, 0]  # token_logp[i] scores tokens[i + 1]
    n, q = len(chunk), len(query)
    s_i = float(-token_logp[n - 1 : n - 1 + q].mean())
    s_p = float(-token_logp[n - 1 + q :].mean()) if labels else None
    return s_i, s_p


@dataclass(frozen=True)
class Scored:
    s_i: float
    s_p: float | None
    labels: list[int]

    @property
    def total(self) -> float:
        return self.s_i + (self.s_p or 0.0)


@torch.inference_mode()
def score(
    model, chunk_list: list[list[int]], query: list[int], pseudo_labels: int | None, rounds: int
) -> list[Scored]:
    """Every chunk's scores (``pseudo_labels`` None: self-information only)."""
    out = []
    for chunk in chunk_list:
        labels = draft_labels(model, chunk, query, pseudo_labels, rounds) if pseudo_labels else []
        s_i, s_p = nll_scores(model, chunk, query, labels)
        out.append(Scored(s_i, s_p, labels))
    return out


def top_k(totals: list[float], k: int) -> list[int]:
    ranked = sorted(range(len(totals)), key=lambda i: (totals[i], i))
    return sorted(ranked[:k])


@torch.inference_mode()
def full_mask_static(
    model, instruction: list[int], selected_chunks: list[list[int]], query: list[int], gen_length: int
) -> tuple[Static, int]:
    """(per-layer static K/V, first position of the query suffix) of a full-mask build."""
    static_tokens = list(instruction) + [t for c in selected_chunks for t in c]
    s = len(static_tokens)
    tokens = torch.tensor(static_tokens + query + [model.config.mask_token_id] * gen_length)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kept.append((k[:, :, :s], v[:, :, :s]))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    model.hidden_states(tokens[None], torch.arange(tokens.numel())[None], attention)
    return kept, s


@dataclass(frozen=True)
class PdllmCase:
    """What a pdllm decode of one request runs on: the selection, the static KV and the query suffix."""

    scores: list[Scored]
    selected: list[int]
    static: Static
    first_position: int
    query: list[int]


def pdllm_case(
    model,
    context: list[int],
    query: list[int],
    instruction: list[int],
    chunk_size: int,
    k: int,
    gen_length: int,
    pseudo_labels: int | None = 4,
    rounds: int = 2,
) -> PdllmCase:
    chunk_list = chunks(context, chunk_size, model.config.bos_token_id)
    scored = score(model, chunk_list, query, pseudo_labels, rounds)
    selected = top_k([s.total for s in scored], k)
    static, first = full_mask_static(model, instruction, [chunk_list[i] for i in selected], query, gen_length)
    return PdllmCase(scored, selected, static, first, query)
