"""Shared-memory budgets for the Triton launchers, and the guard that falls back to a torch reference.

- :func:`smem_limit`: the shared memory one program may use on a device (the opt-in per-block maximum,
  232448 bytes on an H100), read once per device. Off CUDA (the interpreter) it is :data:`H100_SMEM`, so
  CPU runs choose the configs an H100 would.
- :func:`itemsize`: bytes per element of a dtype.
- :func:`warn_once`: one ``pdllm.kernels`` warning per key (a kernel + dtype + shape class).
- :func:`guarded`: run a launch; on Triton's ``OutOfResources`` log once, remember the key and return the
  reference's result (then and on every later call with that key), so a wrong estimate cannot crash a run.

Each kernel module estimates its configs' shared memory itself (tiles x stages x element size) and picks
the largest config that fits with a pure function of (dtype, shape, limit) that CPU tests call directly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

log = logging.getLogger("pdllm.kernels")

H100_SMEM = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (227 KB)
T = TypeVar("T")

_WARNED: set[Hashable] = set()
_FAILED: set[Hashable] = set()


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _triton_smem(index: int) -> int | None:
    """Triton's driver query of the same limit (what its launcher checks against), None if unavailable."""
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - no triton, no driver, another backend: the caller falls back
        return None


@functools.cache
def _cuda_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin:
        return int(optin)
    # Else Triton's query, else the non-opt-in limit every kernel may use.
    return _triton_smem(index) or int(getattr(props, "shared_memory_per_block", 48 * 1024))


def smem_limit(device: torch.device | str | None) -> int:
    """Bytes of shared memory a program may use on ``device`` (cached per device; no sync)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return H100_SMEM
    return _cuda_smem(dev.index if dev.index is not None else torch.cuda.current_device())


def warn_once(key: Hashable, message: str) -> bool:
    """Log ``message`` as a warning the first time ``key`` is seen; True if it was logged now."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    log.warning(message)
    return True


def is_out_of_resources(err: BaseException) -> bool:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - no triton: nothing could have raised it
        return False
    return isinstance(err, OutOfResources)


def guarded(key: Hashable, launch: Callable[[], T], reference: Callable[[], T]) -> T:
    """``launch()``, or ``reference()`` if Triton refused it (or an earlier launch with ``key``) for lack
    of resources; the first refusal per key is logged."""
    if key in _FAILED:
        return reference()
    try:
        return launch()
    except Exception as err:
        if not is_out_of_resources(err):
            raise
        _FAILED.add(key)
        warn_once(("out-of-resources", key), f"{key}: {err}; using the torch reference for this case")
        return reference()


def reset() -> None:
    """Forget warnings, refused launches and cached limits (tests)."""
    _WARNED.clear()
    _FAILED.clear()
    _cuda_smem.cache_clear()
