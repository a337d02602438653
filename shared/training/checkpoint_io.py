"""A training run's checkpoint, both ways: :func:`save` writes the model in the config's save dtype to
``DIR/checkpoint/`` (from a copy: the model in training keeps its device and dtype), and :func:`init_from`
loads a saved checkpoint's weights into a fresh model to start a later stage, refusing one of another shape.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..model.loader import DTYPES, load_model, save_checkpoint
from ..model.transformer import DiffusionLM
from .config import TrainConfigError


def save(model: DiffusionLM, out: Path, tokenizer: Any, dtype: str) -> Path:
    to_save = copy.deepcopy(model).to(device="cpu", dtype=DTYPES[dtype])
    return save_checkpoint(to_save, out / "checkpoint", tokenizer)


def init_from(model: DiffusionLM, path: Path) -> None:
    """Start from a checkpoint's weights (a second training stage): the checkpoint must have this config's
    shape, else TrainConfigError naming the first mismatch."""
    try:
        source = load_model(path, dtype="float32", device="cpu", load_tokenizer=False, pack=False).model
    except (OSError, ValueError) as exc:
        raise TrainConfigError(f"--init-from {path}: {exc}") from exc
    ours, theirs = model.state_dict(), source.state_dict()
    for name, tensor in ours.items():
        other = theirs.get(name)
        if other is None or other.shape != tensor.shape:
            got = "missing" if other is None else tuple(other.shape)
            raise TrainConfigError(
                f"--init-from {path}: {name} is {got}, this config needs {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: theirs[k] for k in ours}, strict=True)
