"""Content-addressed keys for chunk KV.

A key names everything the chunk's K/V depend on: the model (id + revision), the KV dtype, the chunk size,
the position scheme (which positions RoPE was applied at) and the chunk's token ids. Equal inputs give equal
keys on every host and Python version (no ``hash()``; fields are length-prefixed so no two field lists
serialize the same). The readable prefix only helps people scanning Redis; the digest alone decides identity.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

import numpy as np
import torch

KEY_SCHEME = "pdkv1"
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {dtype}")
        return _DTYPE_NAMES[dtype]
    aliases = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "bfloat16": "bf16"}
    name = aliases.get(dtype, dtype)
    if name not in _DTYPE_NAMES.values():
        raise ValueError(f"unsupported KV dtype {dtype!r}")
    return name


def _token_bytes(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError(
                f"token ids must be a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}"
            )
        array = token_ids.detach().to("cpu", torch.int64).numpy()
    else:
        array = np.asarray(token_ids, dtype=np.int64)
        if array.ndim != 1:
            raise ValueError("token ids must be a flat sequence of ints")
    if array.size == 0:
        raise ValueError("a chunk needs at least one token id")
    if (array < 0).any():
        raise ValueError("token ids must be non-negative")
    return array.astype("<i8").tobytes()


def _field(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def chunk_key(
    model_id: str,
    dtype: torch.dtype | str,
    chunk_size: int,
    position_scheme: str,
    token_ids: Sequence[int] | torch.Tensor,
) -> str:
    """``pdkv1:<model slug>:<dtype>:c<chunk size>:<32 hex digits>`` for one chunk's KV."""
    if not model_id:
        raise ValueError("model_id must be non-empty (name + revision)")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not position_scheme:
        raise ValueError("position_scheme must be non-empty")
    dtype_name = _dtype_name(dtype)
    digest = hashlib.blake2b(digest_size=16, person=b"pdllm-chunk-kv")
    for text in (KEY_SCHEME, model_id, dtype_name, str(chunk_size), position_scheme):
        digest.update(_field(text))
    digest.update(_token_bytes(token_ids))
    slug = _SLUG_UNSAFE.sub("_", model_id)[-32:].strip("_") or "model"
    return f"{KEY_SCHEME}:{slug}:{dtype_name}:c{chunk_size}:{digest.hexdigest()}"
