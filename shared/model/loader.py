"""Load and save local Hugging Face checkpoint directories (config.json + safetensors + tokenizer).

No ``trust_remote_code``: Dream and LLaDA configs are mapped onto :class:`ModelConfig` by name, and
LLaDA's OLMo-style parameter names are renamed onto the LLaMA layout the runtime uses.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig, ModelConfigError
from .transformer import DiffusionLM, RotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The checkpoint the project trains and ships (see shared/checkpoints/); the default --model.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "pdllm-needle"


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message names the file and the problem."""


# A checkpoint may carry the settings it was trained for, so commands need no model-specific flags.
SERVING_FILE = "pdllm.json"


@dataclass(frozen=True)
class ServingDefaults:
    """``pdllm.json`` of a checkpoint: its training length and recommended engine settings
    (``EngineConfig`` field names; explicit flags and request fields override them)."""

    train_length: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedModel:
    model: DiffusionLM
    config: ModelConfig
    tokenizer: Any | None
    path: Path
    serving: ServingDefaults = field(default_factory=ServingDefaults)


def read_serving_defaults(model_dir: Path) -> ServingDefaults:
    path = model_dir / SERVING_FILE
    if not path.is_file():
        return ServingDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or set(raw) - {"train_length", "engine"}:
        raise CheckpointError(f"{path}: expected an object with 'train_length' and/or 'engine'")
    length, engine = raw.get("train_length"), raw.get("engine", {})
    if length is not None and (not isinstance(length, int) or length <= 0):
        raise CheckpointError(f"{path}: train_length must be a positive integer, got {length!r}")
    if not isinstance(engine, dict):
        raise CheckpointError(f"{path}: 'engine' must be an object of EngineConfig settings")
    return ServingDefaults(train_length=length, engine=dict(engine))


_LLADA_RENAMES = [
    (r"^model\.transformer\.wte\.weight$", "model.embed_tokens.weight"),
    (r"^model\.transformer\.ln_f\.weight$", "model.norm.weight"),
    (r"^model\.transformer\.ff_out\.weight$", "lm_head.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^model\.transformer\.blocks\.(\d+)\.(q|k|v)_proj\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_out\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.up_proj\.", r"model.layers.\1.mlp.up_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_out\.", r"model.layers.\1.mlp.down_proj."),
]


def canonical_name(name: str) -> str:
    """Map a checkpoint parameter name (HF Qwen2/Llama, Dream or LLaDA) onto the runtime's name."""
    for pattern, repl in _LLADA_RENAMES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def resolve_model_dir(path: str | Path | None) -> Path:
    """``None`` means the shipped default model."""
    p = Path(path).expanduser() if path is not None else DEFAULT_MODEL_DIR
    if not p.is_dir():
        hint = " (the shipped default model is missing from this install)" if path is None else ""
        raise CheckpointError(f"{p}: model directory does not exist{hint}")
    return p


def read_config(model_dir: Path) -> ModelConfig:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from exc
    try:
        return ModelConfig.from_hf_dict(raw, model_id=_model_identity(model_dir, raw))
    except ModelConfigError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from exc


def _model_identity(model_dir: Path, raw: dict[str, Any]) -> str:
    """Name + revision: a digest of the config and the weight files' names and sizes (cheap, stable)."""
    h = hashlib.sha256(json.dumps(raw, sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{model_dir.name}@{h.hexdigest()[:12]}"


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: malformed safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_model(
    path: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    pack: bool | None = None,
) -> LoadedModel:
    """Load a checkpoint directory onto ``device`` in ``dtype``; errors name the file and the problem.

    ``pack`` (default: on CUDA) calls :meth:`DiffusionLM.pack_projections` (inference: fused q/k/v and
    gate/up GEMMs). CPU stays unpacked so its results are those of the plain per-projection GEMMs."""
    model_dir = resolve_model_dir(path)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = read_config(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        model = DiffusionLM(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = canonical_name(key)
                    if name not in expected:
                        if config.tie_word_embeddings and name == "lm_head.weight":
                            continue
                        raise CheckpointError(f"{f}: unexpected parameter {key!r}")
                    tensor = handle.get_tensor(key)
                    if tuple(tensor.shape) != tuple(expected[name]):
                        raise CheckpointError(
                            f"{f}: parameter {key!r} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(expected[name])}"
                        )
                    state[name] = tensor.to(device=device, dtype=torch_dtype)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors file ({exc})") from exc
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{model_dir}: parameters missing from the weight files: {missing[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(config).to(device)
    model.eval()
    if device.type == "cuda" if pack is None else pack:
        model.pack_projections()
    tokenizer = _load_tokenizer(model_dir) if load_tokenizer else None
    serving = read_serving_defaults(model_dir)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=model_dir, serving=serving)


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer alone (the router tokenizes but never loads weights)."""
    tokenizer = _load_tokenizer(model_dir)
    if tokenizer is None:
        raise CheckpointError(f"{model_dir}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return tokenizer


def _load_tokenizer(model_dir: Path) -> Any | None:
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # AutoTokenizer peeks at config.json, whose model_type (Dream, LLaDA) transformers does not know and
    # warns about; the tokenizer files themselves are complete, so that warning only confuses users.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types; surface one clear error
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({exc})") from exc
    finally:
        hf_logging.set_verbosity(level)


def _own_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with its own storage: a packed model's projections are views of one tensor, which
    safetensors refuses to save (a device tensor's ``.cpu()`` is a fresh copy already)."""
    out = t.detach().cpu().contiguous()
    return out.clone() if out.data_ptr() == t.data_ptr() else out


def save_checkpoint(model: DiffusionLM, out_dir: str | Path, tokenizer: Any | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) loadable by :func:`load_model`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    state = {k: _own_cpu_copy(v) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
