"""Engine configuration: one frozen dataclass shared by the in-process engine and the services.

Open choices made here (the paper leaves them implicit):
- ``query_window`` only applies to ``score_mode="query-only"``: self-information over the last W query
  tokens (None: all of them, i.e. the same as "self-info"; the paper's UltraLLaDA setting uses W=64).
  "self-info" and "pseudo-label" always condition on the whole query suffix.
- ``top_k`` larger than the number of chunks is clamped to it (every chunk is kept), not an error.
- ``top_b`` keeps B tokens per selected chunk *including* its BOS, which is always kept.
- ``chunk_boundary="sentence"`` lets a chunk end early, after the last sentence end in its last quarter
  (``layout.split_context``); chunks never exceed ``chunk_size`` context tokens either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

KVMode = Literal["full-mask", "chunk-query", "chunk-only"]
ScoreMode = Literal["pseudo-label", "self-info", "query-only"]
PrefillAttention = Literal["causal", "bidirectional"]
RetentionScore = Literal["bidirectional", "query-to-chunk"]
ChunkBoundary = Literal["fixed", "sentence"]

KV_MODES = ("full-mask", "chunk-query", "chunk-only")
SCORE_MODES = ("pseudo-label", "self-info", "query-only")
PREFILL_ATTENTIONS = ("causal", "bidirectional")
RETENTION_SCORES = ("bidirectional", "query-to-chunk")
CHUNK_BOUNDARIES = ("fixed", "sentence")


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int = 1024
    # "fixed": every chunk but the last has chunk_size tokens; "sentence": a chunk may end after the last
    # sentence end in its last quarter (keeps a fact that straddles a fixed boundary in one chunk).
    chunk_boundary: ChunkBoundary = "fixed"
    top_k: int = 4
    # None: keep every token of a selected chunk.
    top_b: int | None = None
    kv_mode: KVMode = "full-mask"
    score_mode: ScoreMode = "pseudo-label"
    pseudo_labels: int = 4
    pseudo_rounds: int = 2
    prefill_attention: PrefillAttention = "causal"
    retention_score: RetentionScore = "bidirectional"
    # Only for score_mode="query-only" (None: the whole query suffix).
    query_window: int | None = None
    # Chunks forwarded together in one batched prefill / scoring forward (bounds activation memory).
    prefill_batch: int = 64
    # Rows of the attention matrix materialised at once when computing top-B retention scores.
    retention_block: int = 1024

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        if not isinstance(self.top_k, int) or self.top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}")
        if self.top_b is not None and (not isinstance(self.top_b, int) or self.top_b <= 0):
            raise ValueError(f"top_b must be a positive integer or None, got {self.top_b!r}")
        _choice("chunk_boundary", self.chunk_boundary, CHUNK_BOUNDARIES)
        _choice("kv_mode", self.kv_mode, KV_MODES)
        _choice("score_mode", self.score_mode, SCORE_MODES)
        _choice("prefill_attention", self.prefill_attention, PREFILL_ATTENTIONS)
        _choice("retention_score", self.retention_score, RETENTION_SCORES)
        if self.score_mode == "pseudo-label":
            if self.pseudo_labels <= 0:
                raise ValueError(f"pseudo_labels must be positive, got {self.pseudo_labels}")
            if self.pseudo_rounds <= 0 or self.pseudo_rounds > self.pseudo_labels:
                raise ValueError(
                    f"pseudo_rounds must be in [1, pseudo_labels={self.pseudo_labels}], got {self.pseudo_rounds}"
                )
        if self.query_window is not None and self.query_window <= 0:
            raise ValueError(f"query_window must be positive or None, got {self.query_window}")
        if self.prefill_batch <= 0 or self.retention_block <= 0:
            raise ValueError("prefill_batch and retention_block must be positive")

    @classmethod
    def from_settings(cls, base: Mapping[str, Any], **overrides: Any) -> EngineConfig:
        """``base`` (e.g. a checkpoint's recommended settings), then the ``overrides`` that are not None."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(base) - names)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; known: {sorted(names)}")
        cfg = cls(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
        cfg.validate()
        return cfg

    def scoring_window(self) -> int | None:
        """How many trailing query tokens chunk scoring conditions on (None: all of them)."""
        return self.query_window if self.score_mode == "query-only" else None


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
