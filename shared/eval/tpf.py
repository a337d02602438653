"""Tokens per forward (TPF) of ``pdllm eval``'s decodes, and its confidence thresholds.

TPF is the answer tokens a decode produced per model forward of its decoding:

- **tokens**: the response slots up to and including the first EOS; the slots after it (EOS fill, or the
  rest of the EOS's block, unmasked in the same steps) are excluded. Without an EOS: every decoded slot.
- **forwards**: the denoising steps of the request (``GenerationResult.steps``). In the decode worker's
  rounds every step is exactly one model forward over the request's rows, whatever the decode policy: a
  cache refresh (Fast-dLLM's block start or ``--cache-refresh-steps``), a Polestar update, DyLLM's full
  steps and a Sparse-dLLM caching step are that step's forward, not extra ones (the policies' own
  counter, ``GenerationResult.cache["forwards"]``, equals the steps), and a block-diffusion (SDAR) block's
  record rides in the next block's first step. Not counted: the forwards before decoding starts (pdllm's
  chunk prefill, scoring and pseudo-label rounds, the static KV build; SDAR's prompt-block build).

A cell's TPF pools its samples: the sum of their tokens over the sum of their forwards. At one token per
step it is at most 1 (below 1 when an EOS ends a block early, its block's later slots costing steps).
"""

from __future__ import annotations

import math

from pdllm.shared import settings as schema

# The row value of one-token-per-step decoding (no --threshold).
ONE_PER_STEP = None
# What a report's header says of its thresholds (after their list) and of its tpf column.
THRESHOLD_NOTE = (
    " (T: each step unmasks every masked position of the block with confidence above T, at least one;"
    " 1/step: one token per step)"
)
TPF_NOTE = (
    "tokens per forward: answer tokens up to and including each sample's first EOS (slots after it"
    " excluded) over its denoising steps, summed over the cell's samples; one model forward per step (a"
    " policy's cache refresh or update is that step's forward); prefill, chunk scoring and cache builds"
    " before decoding are not counted"
)


def threshold_header(thresholds: list[float | None]) -> str:
    """The header line of a report's thresholds, e.g. ``1/step, 0.9 (T: ...)``."""
    return ", ".join(map(describe, thresholds)) + THRESHOLD_NOTE


def answer_tokens(raw_tokens: list[int], eos_id: int | None, mask_id: int) -> int:
    """Response slots a decode produced: up to and including the first EOS, else every decoded slot."""
    if eos_id is not None and eos_id in raw_tokens:
        return raw_tokens.index(eos_id) + 1
    return sum(t != mask_id for t in raw_tokens)


def tpf(tokens: int, forwards: int) -> float | None:
    """Tokens per forward (None where nothing was forwarded)."""
    return tokens / forwards if forwards else None


def parse_thresholds(text: str | None, flag: str = "--threshold") -> list[float | None]:
    """``--threshold``'s values, in order: None (unset) is one token per step; ``0.7,0.8,0.9`` three
    thresholds; ``none`` in the list adds the one-token-per-step run. Each threshold must be in (0, 1]
    (the generation schema's bound); a value that is not a number, or a repeated one, is refused."""
    if text is None:
        return [ONE_PER_STEP]
    values: list[float | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part.lower() == "none":
            value = None
        else:
            try:
                value = float(part)
            except ValueError:
                raise ValueError(f"{flag}: {part!r} is not a number in (0, 1] or none") from None
            if math.isnan(value) or not 0 < value <= 1:
                raise ValueError(f"{flag} must be in (0, 1] (got {part})")
            schema.validate(schema.GenerationFields, {"threshold": value}, label=lambda _: flag)
        if value in values:
            raise ValueError(f"{flag}: {part} is given twice")
        values.append(value)
    return values


def describe(threshold: float | None) -> str:
    """A threshold as the tables show it: ``1/step`` for one token per step, else the value."""
    return "1/step" if threshold is None else f"{threshold:g}"
