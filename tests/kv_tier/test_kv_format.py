"""Chunk-KV value format: exact round trips and detection of every kind of bad value."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from pdllm.shared.kv_tier.format import (
    FORMAT_VERSION,
    KVCorruptError,
    KVFormatError,
    KVMeta,
    KVMismatchError,
    KVVersionError,
    decode,
    encode,
    header_size,
)
from pdllm.shared.model.config import ModelConfig
from tests.kv_tier.helpers import DTYPES, bitwise_equal, chunk_kv, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layers", "tokens"), [(1, 1), (2, 17), (3, 64)])
def test_round_trip_is_bit_exact(dtype: torch.dtype, layers: int, tokens: int) -> None:
    kv_meta = meta(dtype, layers=layers)
    tensor = chunk_kv(kv_meta, tokens, seed=tokens)
    tensor.view(-1)[::7] = float("nan")  # NaN and -inf bit patterns must survive too
    tensor.view(-1)[1] = float("-inf")
    value = encode(tensor, kv_meta, key="k1")
    assert len(value) == header_size(5) + tensor.numel() * tensor.element_size()
    for buffer in (value, bytes(value), memoryview(value)):
        out = decode(buffer, kv_meta, key="k1")
        assert bitwise_equal(out, tensor)


def test_decode_of_bytearray_is_zero_copy_and_bytes_is_copied() -> None:
    kv_meta = meta()
    value = encode(chunk_kv(kv_meta, 4), kv_meta)
    view = decode(value, kv_meta)
    value[-4:] = b"\0\0\0\0"  # the view shares the buffer ...
    assert view.reshape(-1)[-1].item() == 0.0
    copy = decode(bytes(encode(chunk_kv(kv_meta, 4), kv_meta)), kv_meta)
    copy.add_(1)  # ... while a decoded bytes value is an ordinary writable tensor


def test_encode_accepts_non_contiguous_input() -> None:
    kv_meta = meta()
    wide = chunk_kv(kv_meta, 8).transpose(3, 4).contiguous().transpose(3, 4)
    assert not wide.is_contiguous()
    assert torch.equal(decode(encode(wide, kv_meta), kv_meta), wide)


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((2, 2, 2, 4), torch.float32, "shape"),
        ((3, 2, 2, 4, 8), torch.float32, "shape"),
        ((2, 3, 2, 4, 8), torch.float32, "shape"),
        ((2, 2, 2, 4, 16), torch.float32, "shape"),
        ((2, 2, 2, 0, 8), torch.float32, "0 tokens"),
        ((2, 2, 2, 4, 8), torch.float16, "dtype"),
    ],
)
def test_encode_rejects_tensors_that_are_not_this_models_chunk_kv(
    shape: tuple[int, ...], dtype: torch.dtype, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        encode(torch.zeros(shape, dtype=dtype), meta(torch.float32))


def test_meta_validation_and_from_model_config() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVMeta("m", torch.int8, 1, 1, 1)
    with pytest.raises(ValueError, match="num_layers"):
        KVMeta("m", torch.float32, 0, 1, 1)
    config = ModelConfig(
        family="llada", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=8, model_id="tiny@abc",
    )  # fmt: skip
    assert KVMeta.from_model_config(config, torch.bfloat16) == KVMeta("tiny@abc", torch.bfloat16, 3, 2, 8)


def test_every_header_byte_and_sampled_payload_bytes_are_covered() -> None:
    kv_meta = meta(torch.bfloat16)
    value = encode(chunk_kv(kv_meta, 5), kv_meta, key="k")
    positions = list(range(header_size(5))) + random.Random(0).sample(range(header_size(5), len(value)), 64)
    for position in positions:
        damaged = bytearray(value)
        damaged[position] ^= 0x10
        with pytest.raises(KVFormatError):
            decode(damaged, kv_meta, key="k")


def test_truncated_extended_and_empty_values_are_corrupt() -> None:
    kv_meta = meta()
    value = bytes(encode(chunk_kv(kv_meta, 3), kv_meta))
    for bad in (value[:-1], value[: header_size(5)], value[:10], b"", value + b"\0"):
        with pytest.raises(KVCorruptError):
            decode(bad, kv_meta)
    with pytest.raises(KVCorruptError, match="magic"):
        decode(b"XXXX" + value[4:], kv_meta)


def test_other_format_version_is_a_version_error() -> None:
    kv_meta = meta()
    value = encode(chunk_kv(kv_meta, 3), kv_meta)
    struct.pack_into("<H", value, 4, FORMAT_VERSION + 1)
    with pytest.raises(KVVersionError, match=f"version {FORMAT_VERSION + 1}"):
        decode(value, kv_meta)


@pytest.mark.parametrize(
    "reader",
    [
        meta(model_id="other@r1"),
        meta(layers=3),
        KVMeta("tiny@r1", torch.float32, 2, 4, 4),  # same bytes per token, other layout
        meta(torch.float16),
    ],
)
def test_value_for_another_model_or_layout_is_a_mismatch(reader: KVMeta) -> None:
    writer = meta()
    value = encode(chunk_kv(writer, 6), writer, key="k")
    with pytest.raises(KVMismatchError):
        decode(value, reader, key="k")


def test_value_read_under_another_key_is_a_mismatch() -> None:
    kv_meta = meta()
    value = encode(chunk_kv(kv_meta, 2), kv_meta, key="chunk-a")
    with pytest.raises(KVMismatchError, match="another key"):
        decode(value, kv_meta, key="chunk-b")
