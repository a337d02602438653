"""What the GPU benchmarks share: the model shapes they run (Dream-7B and SDAR-8B with random weights, tiny
CPU smoke models), building such a model on the device, and the device's GEMM / HBM peaks measured in-run."""

from __future__ import annotations

import time

import torch

from pdllm.shared.model.config import ModelConfig
from pdllm.shared.model.transformer import DiffusionLM


def dream7b() -> ModelConfig:
    return ModelConfig(
        family="dream", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=131072,
        attention_bias=True, shift_logits=True, mask_token_id=151666, bos_token_id=151643,
        eos_token_id=151643, pad_token_id=151643, model_id="dream7b-shapes-random",
    )  # fmt: skip


def tiny() -> ModelConfig:
    return ModelConfig(
        family="dream", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=8192, attention_bias=True, shift_logits=True,
        mask_token_id=511, bos_token_id=1, eos_token_id=2, pad_token_id=0, model_id="tiny",
    )  # fmt: skip


def sdar8b() -> ModelConfig:
    """SDAR-8B (Qwen3-8B layout, model block 4): the block-diffusion family's shapes."""
    return ModelConfig(
        family="sdar", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
        mask_token_id=151669, bos_token_id=151643, eos_token_id=151643, pad_token_id=151643, block_size=4,
        model_id="sdar8b-shapes-random",
    )  # fmt: skip


def tiny_sdar() -> ModelConfig:
    return ModelConfig(
        family="sdar", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=8192, mask_token_id=511, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, block_size=4, model_id="tiny-sdar",
    )  # fmt: skip


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> DiffusionLM:
    """Random weights made on the device (a CPU init of 7.6B parameters would take minutes)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DiffusionLM(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval().pack_projections()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peaks(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Achieved bf16 GEMM TFLOP/s and HBM GB/s on this device, now."""
    if device.type != "cuda":
        return {"gemm_tflops": float("nan"), "hbm_gbps": float("nan")}
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps, t = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    tflops = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    reps, t = 10, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    gbps = 2 * src.numel() * reps / (time.perf_counter() - t) / 1e9
    del a, b, src, dst
    return {"gemm_tflops": tflops, "hbm_gbps": gbps}
