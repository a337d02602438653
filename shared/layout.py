"""How one request's tokens are laid out: chunks for prefill/scoring, positions for build and decode.

Decode prompt: ``[instruction] [BOS c_1] ... [BOS c_K] [query suffix] [response]`` with the selected chunks
in document order. Positions are continuous across the selected chunks (a chunk starts right after the
previous *selected* chunk, whatever lies between them in the document), the query follows the last one.
With top-B the kept tokens keep these positions; the dropped ones leave holes (the query does not move).
Instruction and query never enter the chunk pool.

Chunk boundaries (``EngineConfig.chunk_boundary``): "fixed" cuts every ``chunk_size`` tokens; "sentence"
lets a chunk end earlier, right after the last sentence-end token (``sentence_end_ids``) among its last
quarter of tokens, so it keeps at least ``ceil(0.75 * chunk_size)`` tokens; with no sentence end there it
is cut at ``chunk_size`` as before. Either way the chunks concatenate back to the context exactly.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdllm.shared.config import EngineConfig


@dataclass(frozen=True)
class Request:
    """Token ids of one request; ``chunks[i]`` already starts with its BOS."""

    instruction: list[int]
    chunks: list[list[int]]
    query: list[int]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


def _ids(name: str, ids: Sequence[int] | torch.Tensor | None) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 1:
            raise ValueError(f"{name} ids must be 1-D, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    out = [int(t) for t in ids]
    if any(t < 0 for t in out):
        raise ValueError(f"{name} ids must be non-negative")
    return out


# A token ends a sentence when its text ends with . ! ? (then maybe whitespace / closing quotes) or holds a
# newline.
_SENTENCE_END = re.compile(r"""[.!?][\s"'\u201d\u2019\u00bb]*$""")


def sentence_end_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokens that end a sentence (decoded text per the rule above; special tokens never do)."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else int(tokenizer.vocab_size)
    ends = set()
    for i in range(size):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if "\n" in text or _SENTENCE_END.search(text):
            ends.add(i)
    return frozenset(ends)


def split_context(
    context: Sequence[int],
    chunk_size: int,
    boundary: str = "fixed",
    sentence_ends: Collection[int] | None = None,
) -> list[list[int]]:
    """The context's chunks (no BOS), each at most ``chunk_size`` tokens; see the module docstring."""
    c, n = chunk_size, len(context)
    if boundary == "fixed":
        return [list(context[i : i + c]) for i in range(0, n, c)]
    if boundary != "sentence":
        raise ValueError(f"chunk_boundary must be one of fixed, sentence; got {boundary!r}")
    if sentence_ends is None:
        raise ValueError("chunk_boundary='sentence' needs the sentence-end token ids (sentence_end_ids)")
    min_len = -(-3 * c // 4)  # ceil(0.75 * c)
    chunks, start = [], 0
    while start < n:
        end = min(start + c, n)
        if end < n:
            # The last sentence end at index >= start + min_len - 1, so the chunk keeps >= min_len tokens.
            for j in range(end - 1, start + min_len - 2, -1):
                if context[j] in sentence_ends:
                    end = j + 1
                    break
        chunks.append(list(context[start:end]))
        start = end
    return chunks


def make_request(
    context_ids: Sequence[int] | torch.Tensor,
    question_ids: Sequence[int] | torch.Tensor,
    bos_id: int | None,
    config: EngineConfig,
    vocab_size: int,
    instruction_ids: Sequence[int] | torch.Tensor | None = None,
    sentence_ends: Collection[int] | None = None,
) -> Request:
    """Validate the request and split the context into BOS-prefixed chunks of at most ``chunk_size``
    tokens (``sentence_ends``: the tokenizer's sentence-end ids, needed by ``chunk_boundary="sentence"``)."""
    context = _ids("context", context_ids)
    query = _ids("question", question_ids)
    instruction = _ids("instruction", instruction_ids)
    if not context:
        raise ValueError("context is empty: Prefilling-dLLM needs at least one context token")
    if not query:
        raise ValueError("question is empty: chunk scoring and decoding need at least one query token")
    if bos_id is None:
        raise ValueError("the model has no BOS token id; chunked prefill prepends a BOS to every chunk")
    for name, ids in (("context", context), ("question", query), ("instruction", instruction)):
        if ids and max(ids) >= vocab_size:
            raise ValueError(f"{name} has token id {max(ids)} >= vocab size {vocab_size}")
    parts = split_context(context, config.chunk_size, config.chunk_boundary, sentence_ends)
    chunks = [[bos_id, *part] for part in parts]
    return Request(instruction=instruction, chunks=chunks, query=query)


@dataclass(frozen=True)
class DecodeLayout:
    """Positions of the static prefix (instruction + selected chunks) and of the decoded tokens."""

    instruction_len: int
    chunk_ids: list[int]  # selected chunk indices, document order
    chunk_lens: list[int]  # tokens per selected chunk including BOS
    query_len: int
    gen_length: int

    @property
    def chunk_starts(self) -> list[int]:
        starts, pos = [], self.instruction_len
        for n in self.chunk_lens:
            starts.append(pos)
            pos += n
        return starts

    @property
    def static_len(self) -> int:
        return self.instruction_len + sum(self.chunk_lens)

    @property
    def local_len(self) -> int:
        """Tokens recomputed every decode step: query suffix + response."""
        return self.query_len + self.gen_length

    def local_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.arange(self.static_len, self.static_len + self.local_len, device=device)


def decode_layout(request: Request, selected: Sequence[int], gen_length: int) -> DecodeLayout:
    chosen = sorted(int(i) for i in selected)
    return DecodeLayout(
        instruction_len=len(request.instruction),
        chunk_ids=chosen,
        chunk_lens=[len(request.chunks[i]) for i in chosen],
        query_len=len(request.query),
        gen_length=gen_length,
    )


def select_top_k(totals: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` lowest scores (ties: earlier chunk first), returned in document order."""
    k = min(k, len(totals))
    order = sorted(range(len(totals)), key=lambda i: (totals[i], i))
    return sorted(order[:k])


def kept_count(n: int, budget: int | None) -> int:
    """How many of a chunk's ``n`` tokens :func:`keep_top_b` keeps (``budget``: B >= 1, None: all)."""
    return n if budget is None or budget >= n else budget


def keep_top_b(scores: torch.Tensor, budget: int | None) -> torch.Tensor:
    """Indices (sorted) of the tokens a chunk keeps: its BOS (index 0) and the ``budget - 1`` best others."""
    n = scores.shape[0]
    if budget is None or budget >= n:
        return torch.arange(n, device=scores.device)
    rest = scores[1:].double()
    # Stable order on exact ties: a lower index wins, the same in the reference and the fast path.
    order = torch.sort(-rest, stable=True).indices[: budget - 1] + 1
    zero = torch.zeros(1, dtype=order.dtype, device=order.device)
    return torch.sort(torch.cat([zero, order])).values
