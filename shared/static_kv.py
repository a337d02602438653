"""The static decode KV: what the KV build (step 6) hands to the denoising loop (step 7).

The decode worker's batched rounds (``decode_service.scheduler``, in the worker and in process) copy it
into their KV pool; the single-request reference loops (``tests/reference/static_kv.py``) read it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StaticKV:
    """The static KV of one request's selected chunks.

    ``segments``: chunk-KV-layout tensors ``[layers, 2, Hkv, L, D]`` (instruction first if any, then the
    selected chunks in document order, top-B already applied); ``query_start``: position of the first
    query-suffix token; ``contiguous``: the same KV as one tensor when a single build forward produced it
    (lets :meth:`tensor` skip the concatenation), else None; ``kept_tokens``: tokens kept per selected chunk.
    """

    segments: list[torch.Tensor]
    query_start: int
    contiguous: torch.Tensor | None = None
    kept_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.shape[3]) for s in self.segments)

    def tensor(self) -> torch.Tensor:
        """All static KV as one ``[layers, 2, Hkv, S, D]`` tensor (the build's own when it made one)."""
        return self.contiguous if self.contiguous is not None else torch.cat(self.segments, dim=3)
