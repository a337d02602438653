"""The unmasking decision of :class:`~.sampler.DenoiseState` as device ops (greedy decoding).

:class:`~.sampler.DenoiseState` copies each step's predictions to the host and decides there which
positions to unmask; here the same decision runs as tensor ops of fixed shape on the logits' device, so a
decode step needs no device-to-host copy and no host input:

- :func:`unmask_window`: one step over a batch of block windows: the ``k`` most confident predictions
  (ties to the lower position, as the stable sort of the reference does) or Fast-dLLM's threshold (every
  prediction above tau, else the single most confident one).
- :class:`DeviceUnmasker`: one request's whole state machine (block, step in block, schedule counts, EOS
  stop) in device tensors, replayable inside a CUDA graph after the forward (single-request decode).

The batched rounds keep each request's place in the schedule on the host instead
(``decode_service/device_state.py``).
Sampled decoding (temperature > 0) stays on :class:`~.sampler.DenoiseState`: its draws come from a seeded
CPU generator, which no device sampler reproduces.
"""

from __future__ import annotations

import torch

from pdllm.shared.generation.sampler import GenerationConfig, greedy_predictions, step_schedule


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


class DeviceUnmasker:
    """One greedy request's unmasking state on the device, for a fixed gen length and block length.

    :meth:`step` reads the logits of every response position (``[gen_length, V]``, row i predicting
    position i) and updates the response tokens in place, with no host sync and no host input: what it
    needs from the schedule is in device tables (:meth:`reset`), so a CUDA graph can capture it once and
    replay it every step. Once :attr:`finished` a step changes nothing. :attr:`steps_taken`,
    :attr:`block` and :attr:`finished` mirror :class:`~.sampler.DenoiseState`.
    """

    def __init__(
        self,
        gen_length: int,
        block_length: int,
        mask_id: int,
        eos_id: int | None,
        device: torch.device,
    ) -> None:
        if gen_length % block_length:
            raise ValueError(f"gen_length={gen_length} is not divisible by block_length={block_length}")
        self.gen_length, self.block_length = gen_length, block_length
        self.num_blocks = gen_length // block_length
        self.mask_id, self.eos_id = mask_id, eos_id
        self.block = torch.zeros((), dtype=torch.long, device=device)
        self.step_in_block = torch.zeros((), dtype=torch.long, device=device)
        self.steps_taken = torch.zeros((), dtype=torch.long, device=device)
        self.finished = torch.zeros((), dtype=torch.bool, device=device)
        # tokens to unmask at each step of a block (a block has at most block_length steps)
        self.k_table = torch.zeros(block_length + 1, dtype=torch.long, device=device)
        self.last_step = torch.zeros((), dtype=torch.long, device=device)
        self.threshold = torch.zeros(1, dtype=torch.float32, device=device)
        self.use_threshold = torch.zeros(1, dtype=torch.bool, device=device)
        self.stop_at_eos = torch.zeros((), dtype=torch.bool, device=device)
        self._slots = torch.arange(block_length, device=device)
        self._positions = torch.arange(gen_length, device=device)

    def reset(self, config: GenerationConfig) -> None:
        """Start a request (its response must be all [MASK]); a few small blocking copies, once."""
        config.validate()
        if (config.gen_length, config.block) != (self.gen_length, self.block_length):
            raise ValueError(
                f"unmasker is for gen {self.gen_length} / block {self.block_length}, "
                f"got {config.gen_length} / {config.block}"
            )
        if config.temperature != 0:
            raise ValueError("sampled decoding draws on the host: use DenoiseState")
        schedule = step_schedule(self.block_length, config.steps // self.num_blocks)
        table = schedule + [0] * (self.k_table.shape[0] - len(schedule))
        for buf in (self.block, self.step_in_block, self.steps_taken, self.finished):
            buf.zero_()
        self.k_table.copy_(torch.tensor(table))
        self.last_step.fill_(len(schedule) - 1)
        self.threshold.fill_(config.threshold or 0.0)
        self.use_threshold.fill_(config.threshold is not None)
        self.stop_at_eos.fill_(config.stop_at_eos)

    def step(self, logits: torch.Tensor, response: torch.Tensor) -> None:
        """One denoising step: ``logits`` ``[gen_length, V]`` of this step's forward, ``response``
        ``[gen_length]`` updated in place."""
        live = ~self.finished
        lo = self.block.clamp(max=self.num_blocks - 1) * self.block_length
        at = lo + self._slots
        window = response.index_select(0, at)
        confidence, predicted = greedy_predictions(logits.index_select(0, at), self.mask_id)
        left = (window == self.mask_id).sum()
        scheduled = self.k_table.gather(0, self.step_in_block.clamp(max=self.block_length).view(1))[0]
        k = torch.where(self.step_in_block >= self.last_step, left, torch.minimum(scheduled, left))
        new = unmask_window(
            window[None],
            confidence[None],
            predicted[None],
            k.view(1),
            self.threshold,
            self.use_threshold,
            self.mask_id,
        )[0]
        response.index_copy_(0, at, torch.where(live, new, window))
        took = live.long()
        self.steps_taken.add_(took)
        self.step_in_block.add_(took)
        ended = live & ~(new == self.mask_id).any()
        self.step_in_block.masked_fill_(ended, 0)
        self.block.add_(ended.long())
        stop = self.block >= self.num_blocks
        if self.eos_id is not None:
            seen = ((response == self.eos_id) & (self._positions < self.block * self.block_length)).any()
            stop = stop | (ended & self.stop_at_eos & seen)
        self.finished.logical_or_(stop)

    def checks_after(self, config: GenerationConfig) -> tuple[int, set[int]]:
        """(most steps the request can take, the steps after which only :attr:`finished` tells whether it
        stopped). A fixed schedule ends after exactly ``num_blocks * steps per block`` steps unless EOS
        stops it at the end of an earlier block; a threshold unmasks at least one token per step."""
        if config.threshold is not None:
            return self.gen_length, set(range(self.gen_length))
        per_block = len(step_schedule(self.block_length, config.steps // self.num_blocks))
        total = per_block * self.num_blocks
        if not config.stop_at_eos or self.eos_id is None:
            return total, set()
        return total, {per_block * (b + 1) - 1 for b in range(self.num_blocks - 1)}
