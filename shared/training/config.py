"""Training configuration: one JSON file -> :class:`TrainConfig` (model shape, data mix, optimizer)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import DataConfig


class TrainConfigError(ValueError):
    """The training config file is missing, malformed or names unknown fields."""


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    # None: Dream layout (bidirectional, q/k/v bias, shifted logits). An int: SDAR layout (block diffusion
    # with blocks of this many positions, Qwen3's per-head q/k RMSNorm, no bias, unshifted logits), trained
    # with ``objective.py``'s block-diffusion loss.
    block_size: int | None = None


@dataclass(frozen=True)
class TrainConfig:
    name: str = "pdllm-needle"
    model: ModelShape = field(default_factory=ModelShape)
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = 0
    max_steps: int = 20000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # MDLM/LLaDA: a row's masking probability is (1 - eps) * t + eps with t ~ U(0, 1).
    mask_eps: float = 1e-3
    num_workers: int = 8
    log_every: int = 25
    save_every_minutes: float = 2.0
    compile: bool = False
    device: str = "auto"
    # Weights are written in this dtype (bfloat16 keeps the shipped file small).
    save_dtype: str = "bfloat16"


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise TrainConfigError(f"{where}: unknown field(s) {unknown} (known: {sorted(names)})")
    kwargs = {}
    for key, value in raw.items():
        if key == "model":
            value = _build(ModelShape, value, f"{where}.model")
        elif key == "data":
            value = _build(DataConfig, value, f"{where}.data")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def load_config(path: str | Path) -> TrainConfig:
    p = Path(path)
    if not p.is_file():
        raise TrainConfigError(f"{p}: training config not found")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise TrainConfigError(f"{p}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise TrainConfigError(f"{p}: expected a JSON object at the top level")
    try:
        return _build(TrainConfig, raw, p.name)
    except TypeError as exc:
        raise TrainConfigError(f"{p}: {exc}") from exc


def to_dict(config: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
