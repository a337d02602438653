"""Training configuration: one JSON file -> :class:`TrainConfig` (model shape, data mix, optimizer), and what
a run derives from it: the model's :class:`ModelConfig`, the prose file's path and the ``--smoke`` variant.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.config import ModelConfig
from .data import DataConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


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
        cfg = _build(TrainConfig, raw, p.name)
    except TypeError as exc:
        raise TrainConfigError(f"{p}: {exc}") from exc
    data = cfg.data
    if not 0.0 <= data.block_mask_share <= 1.0 or data.block_mask_length < 1:
        raise TrainConfigError(f"{p}: block_mask_share must be in [0, 1], block_mask_length >= 1")
    if data.block_mask_share > 0 and cfg.model.block_size is not None:
        raise TrainConfigError(f"{p}: block_mask_share is for Dream-layout models (model.block_size unset)")
    return cfg


def to_dict(config: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def build_model_config(cfg: TrainConfig, tokenizer: Any) -> ModelConfig:
    """Dream layout by default; SDAR layout (the block-diffusion family, as ``ModelConfig.from_hf_dict``
    reads an SDAR checkpoint back: q/k norm on, no attention bias, unshifted logits) with ``block_size``."""
    m = cfg.model
    sdar = m.block_size is not None
    return ModelConfig(
        family="sdar" if sdar else "dream",
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_position_embeddings,
        attention_bias=not sdar,
        qk_norm=sdar,
        block_size=m.block_size,
        tie_word_embeddings=True,
        shift_logits=not sdar,
        mask_token_id=tokenizer.mask_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        model_id=cfg.name,
    )


def prose_path(cfg: TrainConfig) -> Path:
    """The config's prose file: relative paths are relative to this folder (``data/prose/...``)."""
    path = Path(cfg.data.prose_file)
    return path if path.is_absolute() else Path(__file__).resolve().parent / path


def smoke_variant(cfg: TrainConfig) -> TrainConfig:
    """``--smoke --config FILE``: FILE's data mix (modes, tasks, sequence length, phases) at the scale of
    ``configs/smoke.json`` (its model, steps, optimizer, CPU, no workers), so that a minute on a CPU runs
    every row type the config draws; the model keeps the config's layout (``block_size``: SDAR). Batches
    hold one full-length row; the causal phase and the length curriculum are cut to the first half of the
    run so that both phases are exercised."""
    smoke = load_config(CONFIG_DIR / "smoke.json")
    half = smoke.max_steps // 2
    data = dataclasses.replace(
        cfg.data,
        tokens_per_batch=cfg.data.seq_len,
        causal_phase_steps=min(cfg.data.causal_phase_steps, half),
        curriculum_steps=min(cfg.data.curriculum_steps, half),
    )
    keep = ("name", "seed")  # the rest comes from smoke.json
    model = dataclasses.replace(smoke.model, block_size=cfg.model.block_size)
    return dataclasses.replace(smoke, data=data, model=model, **{k: getattr(cfg, k) for k in keep})
