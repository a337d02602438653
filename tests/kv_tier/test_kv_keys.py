"""Chunk keys: stable, sensitive to every input, and checked for bad input."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from pdllm.shared.kv_tier.keys import chunk_key


def reference_key(model_id: str, dtype: str, chunk_size: int, scheme: str, tokens: list[int]) -> str:
    """The key spelled out independently from the documented scheme."""
    digest = hashlib.blake2b(digest_size=16, person=b"pdllm-chunk-kv")
    for text in ("pdkv1", model_id, dtype, str(chunk_size), scheme):
        digest.update(struct.pack("<I", len(text.encode())) + text.encode())
    digest.update(b"".join(struct.pack("<q", t) for t in tokens))
    return digest.hexdigest()


def test_key_matches_reference_and_is_pinned() -> None:
    tokens = [1, 151643, 42, 0, 7]
    key = chunk_key("Dream-org/Dream-v0-Base-7B@main", torch.bfloat16, 512, "local", tokens)
    expected = reference_key("Dream-org/Dream-v0-Base-7B@main", "bf16", 512, "local", tokens)
    assert key == f"pdkv1:Dream-org_Dream-v0-Base-7B_main:bf16:c512:{expected}"
    # Pinned: a change here silently invalidates every deployed cache, so it must be deliberate.
    assert expected == "dc99dc9be014172a1d6c55e73ff68b87"


def test_token_id_containers_and_dtype_aliases_agree() -> None:
    tokens = [5, 6, 7, 1 << 40]
    keys = {
        chunk_key("m", torch.float16, 4, "local", tokens),
        chunk_key("m", "float16", 4, "local", tuple(tokens)),
        chunk_key("m", "fp16", 4, "local", torch.tensor(tokens)),
        chunk_key("m", "f16", 4, "local", np.array(tokens, dtype=np.int64)),
        chunk_key("m", torch.float16, 4, "local", torch.tensor(tokens, dtype=torch.int64, device="cpu")),
    }
    assert len(keys) == 1


def test_every_input_changes_the_key() -> None:
    base = ("m@1", torch.float32, 8, "local", [1, 2, 3])
    variants = [
        ("m@2", torch.float32, 8, "local", [1, 2, 3]),
        ("m@1", torch.bfloat16, 8, "local", [1, 2, 3]),
        ("m@1", torch.float32, 16, "local", [1, 2, 3]),
        ("m@1", torch.float32, 8, "global", [1, 2, 3]),
        ("m@1", torch.float32, 8, "local", [1, 2, 4]),
        ("m@1", torch.float32, 8, "local", [1, 2]),
        ("m@1", torch.float32, 8, "local", [1, 2, 3, 0]),
        ("m@1", torch.float32, 8, "local", [2, 1, 3]),
    ]
    keys = {chunk_key(*base)} | {chunk_key(*v) for v in variants}
    assert len(keys) == len(variants) + 1


def test_field_boundaries_cannot_be_shifted() -> None:
    assert chunk_key("ab", "f32", 8, "c", [1]) != chunk_key("a", "f32", 8, "bc", [1])
    # Same slug, different ids: the digest alone decides identity.
    assert chunk_key("a/b", "f32", 8, "s", [1]) != chunk_key("a_b", "f32", 8, "s", [1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "f32", 8, "local", [1]), "model_id"),
        (("m", "int8", 8, "local", [1]), "dtype"),
        (("m", torch.int32, 8, "local", [1]), "dtype"),
        (("m", "f32", 0, "local", [1]), "chunk_size"),
        (("m", "f32", 8, "", [1]), "position_scheme"),
        (("m", "f32", 8, "local", []), "at least one token"),
        (("m", "f32", 8, "local", [1, -2]), "non-negative"),
        (("m", "f32", 8, "local", [[1, 2]]), "flat"),
        (("m", "f32", 8, "local", torch.ones(2, 2, dtype=torch.long)), "1-D integer"),
        (("m", "f32", 8, "local", torch.ones(3)), "1-D integer"),
    ],
)
def test_bad_input_is_rejected(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_key(*args)
