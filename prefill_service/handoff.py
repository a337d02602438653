"""What a prefill worker hands off to a decode worker when the request asks for it (``offer_handoff``).

Full-mask and chunk-query: the decode KV itself, built here by the injected ``DecodeKVBuild`` (the decode
worker's own build, passed in by the composition: this package never imports the decode service), so the
decode worker's GPU does no forward over the chunks. Chunk-only: the selected chunks' step-3 KV straight
from the prefill bank (causal chunk prefill only, the scheme the decode worker reads). The payload leaves
through ``pdllm.shared.kv_transfer``'s sender.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdllm.shared.chunk_store import position_scheme
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_transfer.payload import CHUNK_KV, DECODE_KV, decode_kv_scheme, pack_segments, pack_static
from pdllm.shared.layout import Request
from pdllm.shared.static_kv import StaticKV

# (request, selected chunk ids, decoding settings, engine settings) -> the static decode KV.
DecodeKVBuild = Callable[[Request, Sequence[int], GenerationConfig, EngineConfig], StaticKV]


@dataclass
class HandoffKV:
    kv: torch.Tensor  # [layers, 2, Hkv, tokens, D], contiguous
    payload: str  # DECODE_KV | CHUNK_KV
    segment_lens: list[int]
    position_scheme: str
    instruction_len: int = 0
    query_start: int = 0
    seconds: float = field(default=0.0, compare=False)


def handoff_kv(
    request: Request,
    selected: Sequence[int],
    bank_segments: Callable[[int], torch.Tensor] | None,
    gen: GenerationConfig,
    config: EngineConfig,
    build: DecodeKVBuild | None,
) -> HandoffKV | None:
    """The KV to hand off for one selection (None: nothing this worker can offer for this request).
    ``bank_segments(i)``: chunk ``i``'s step-3 KV from the prefill bank."""
    if config.kv_mode == "chunk-only":
        if bank_segments is None or config.prefill_attention != "causal":
            return None  # the decode worker reads bidirectional chunk KV it makes itself
        kv, lens = pack_segments([bank_segments(i) for i in selected])
        return HandoffKV(kv, CHUNK_KV, lens, position_scheme("causal"))
    if build is None:
        return None
    static = build(request, selected, gen, config)
    kv, lens, instruction = pack_static(static)
    return HandoffKV(kv, DECODE_KV, lens, decode_kv_scheme(config.kv_mode), instruction, static.query_start)
