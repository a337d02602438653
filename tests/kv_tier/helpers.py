"""Small builders shared by the KV-tier tests."""

from __future__ import annotations

import torch

from pdllm.shared.kv_tier.format import KVMeta

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def meta(dtype: torch.dtype = torch.float32, model_id: str = "tiny@r1", layers: int = 2) -> KVMeta:
    return KVMeta(model_id=model_id, dtype=dtype, num_layers=layers, num_kv_heads=2, head_dim=8)


def chunk_kv(kv_meta: KVMeta, tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (kv_meta.num_layers, 2, kv_meta.num_kv_heads, tokens, kv_meta.head_dim)
    return torch.randn(shape, generator=gen).to(kv_meta.dtype)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equality of the stored bits (NaN payloads included), not of the float values."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
