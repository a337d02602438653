"""The unmasking decision of :class:`~.sampler.DenoiseState` as device ops (greedy decoding).

:class:`~.sampler.DenoiseState` copies each step's predictions to the host and decides there which
positions to unmask; here the same decision runs as tensor ops of fixed shape on the logits' device, so a
decode step needs no device-to-host copy and no host input:

- :func:`unmask_window`: one step over a batch of block windows: the ``k`` most confident predictions
  (ties to the lower position, as the stable sort of the reference does) or Fast-dLLM's threshold (every
  prediction above tau, else the single most confident one).

The batched rounds keep each request's place in the schedule on the host (``decode_service/device_state.py``).
Sampled decoding (temperature > 0) stays on :class:`~.sampler.DenoiseState`: its draws come from a seeded
CPU generator, which no device sampler reproduces.
"""

from __future__ import annotations

import torch


def to_device(
    values: list[int] | list[float] | list[bool] | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` (host) as a tensor on ``device``. To CUDA through pinned memory without waiting: a plain
    host-to-device copy synchronizes the stream, which would stall the host behind queued work."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def unmask_window(
    window: torch.Tensor,
    confidence: torch.Tensor,
    predicted: torch.Tensor,
    k: torch.Tensor,
    threshold: torch.Tensor,
    use_threshold: torch.Tensor,
    mask_id: int,
) -> torch.Tensor:
    """One unmasking step of ``B`` block windows (``[B, L]`` tokens); returns the new windows.

    Only slots holding ``mask_id`` can change. ``confidence`` (float32) / ``predicted`` ``[B, L]``: each
    slot's prediction (ignored elsewhere). Row ``b`` unmasks its ``k[b]`` most confident masked slots, or,
    where ``use_threshold[b]``, every masked slot with confidence > ``threshold[b]`` (float32, as the
    reference compares), else its most confident one. Callers pass ``k <=`` the masked count.
    """
    masked = window == mask_id
    # confidences are probabilities (>= 0): -1 sorts every slot that is not masked after the masked ones
    key = torch.where(masked, confidence, -1.0)
    slots = torch.arange(window.shape[1], device=window.device).expand_as(window)
    # ties keep slot order, i.e. the lower position first, exactly like the reference's stable sort
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, slots)
    by_schedule = rank < k[:, None]
    above = key > threshold[:, None]
    first = key.argmax(dim=-1, keepdim=True)  # the first maximum, as the reference's argmax
    by_threshold = above | (~above.any(dim=-1, keepdim=True) & (slots == first))
    chosen = masked & torch.where(use_threshold[:, None], by_threshold, by_schedule)
    return torch.where(chosen, predicted, window)
