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
from typing import Any

from pdllm.shared import settings
from pdllm.shared.settings import ChunkBoundary, KVMode, PrefillAttention, RetentionScore, ScoreMode

# The settings, their defaults, bounds, choices and help are declared once, in `shared/settings.py`.

_DEFAULTS = settings.EngineSettings()


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (``settings.EngineSettings`` under the engine's names); validated on creation."""

    chunk_size: int = _DEFAULTS.chunk_size
    chunk_boundary: ChunkBoundary = _DEFAULTS.chunk_boundary
    top_k: int = _DEFAULTS.top_k
    top_b: int | None = _DEFAULTS.top_b  # None: keep every token of a selected chunk
    kv_mode: KVMode = _DEFAULTS.kv_mode
    score_mode: ScoreMode = _DEFAULTS.score_mode
    pseudo_labels: int = _DEFAULTS.pseudo_label_tokens
    pseudo_rounds: int = _DEFAULTS.pseudo_label_rounds
    prefill_attention: PrefillAttention = _DEFAULTS.prefill_attention
    retention_score: RetentionScore = _DEFAULTS.retention_score
    query_window: int | None = _DEFAULTS.query_window  # only for score_mode="query-only"
    prefill_batch: int = _DEFAULTS.prefill_batch
    retention_block: int = _DEFAULTS.retention_block

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ``settings.SettingError`` (a ValueError) naming the first field the schema refuses."""
        label = lambda s: settings.engine_name(settings.EngineSettings, s) or s
        settings.validate(settings.EngineSettings, settings.engine_values(self), label=label)

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
