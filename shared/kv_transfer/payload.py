"""What a KV handoff carries, and the identity both sides must share.

Two payloads: ``decode-kv``, a request's built static decode KV (instruction segment first, then the kept
tokens of each selected chunk), and ``chunk-kv``, the selected chunks' step-3 KV (chunk-only mode: the decode
worker re-rotates it itself). Either is one ``[layers, 2, Hkv, tokens, D]`` tensor plus the segment lengths,
which is all the receiver needs to rebuild the same :class:`StaticKV` / segment list; a decode-kv payload
travels in the decode pool's page tiles (``pages.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.static_kv import StaticKV

DECODE_KV = "decode-kv"
CHUNK_KV = "chunk-kv"
SPEC_FIELDS = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "position_scheme", "chunk_size")


WIRE_PAGE = 64  # tokens per tile of a decode-kv payload on the wire: the decode pool's page size


def decode_kv_scheme(kv_mode: str) -> str:
    """The position scheme of a built decode KV: continuous positions, from a forward in ``kv_mode``, sent
    in ``WIRE_PAGE``-token tiles. The tiling is part of the name so that a peer with another wire layout
    is refused by the spec check (FAILED_PRECONDITION) before any byte moves; a CUDA IPC mapping would
    otherwise read the wrong shape without noticing."""
    return f"continuous-{kv_mode}/tiles-{WIRE_PAGE}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_kv_spec(model: torch.nn.Module, position_scheme: str, chunk_size: int) -> wpb.KvSpec:
    """The identity of KV this model computes (``model_id`` carries the revision)."""
    cfg = model.config  # type: ignore[attr-defined]
    return wpb.KvSpec(
        model_id=cfg.model_id,
        dtype=dtype_name(next(model.parameters()).dtype),
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        position_scheme=position_scheme,
        chunk_size=chunk_size,
    )


def check_kv_spec(got: wpb.KvSpec, expected: wpb.KvSpec, what: str, request_id: str = "") -> None:
    """FAILED_PRECONDITION when ``got`` (``what``: whose KV) was not made the way this worker makes it.
    A zero chunk size on either side is "not stated" and not compared."""
    for name in SPEC_FIELDS:
        theirs, ours = getattr(got, name), getattr(expected, name)
        if name == "chunk_size" and not (theirs and ours):
            continue
        if theirs != ours:
            raise PdllmError(
                f"{what} was made with {name}={theirs!r} but this worker has {name}={ours!r}",
                code=grpc.StatusCode.FAILED_PRECONDITION,
                request_id=request_id or None,
            )


def pack_segments(segments: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One contiguous tensor of ``segments`` along the token axis, and their lengths."""
    lens = [int(s.shape[3]) for s in segments]
    return torch.cat(list(segments), dim=3).contiguous(), lens


def unpack_segments(kv: torch.Tensor, lens: Sequence[int]) -> list[torch.Tensor]:
    if sum(lens) != kv.shape[3]:
        raise ValueError(f"handoff segments cover {sum(lens)} tokens, the KV has {kv.shape[3]}")
    return list(kv.split(list(lens), dim=3))


def pack_static(static: StaticKV) -> tuple[torch.Tensor, list[int], int]:
    """A decode-kv payload: the tensor, segment lengths and the instruction's length."""
    kv = static.tensor().contiguous()
    instruction = kv.shape[3] - sum(static.kept_tokens)
    lens = ([instruction] if instruction else []) + list(static.kept_tokens)
    return kv, lens, instruction


def unpack_static(kv: torch.Tensor, handoff: wpb.KvHandoff) -> StaticKV:
    """The :class:`StaticKV` a decode-kv payload was packed from (segments are views of ``kv``)."""
    segments = unpack_segments(kv, handoff.segment_lens)
    kept = list(handoff.segment_lens[1:] if handoff.instruction_len else handoff.segment_lens)
    return StaticKV(segments, handoff.query_start, kv, kept)
