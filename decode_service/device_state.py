"""Greedy requests whose response lives on the device, stepped many at a time (batched decode rounds).

:class:`DeviceDenoiseState` keeps one request's tokens on the device and its place in the schedule
(block, step in block, steps taken, masked positions left in the block) on the host. With a fixed
schedule every step unmasks exactly the scheduled count, so the host knows without reading the device how
many logit rows each request needs, when its block ends and when it is done; so does a replayed schedule
(``GenerationConfig.schedule``), which is a fixed schedule with recorded counts. :class:`DeviceBatch` runs one
step of several states: it finds the masked positions on the device (the rows the forward must compute
logits for), and turns those rows' logits into unmasked tokens with
:func:`~.device_sampler.unmask_window`. The host reads the device back only where the schedule cannot
tell: threshold mode (how many were unmasked) and the end of a non-final block when EOS may stop the
request; then one small copy serves every state of the step.
"""

from __future__ import annotations

import torch

from pdllm.shared.generation.device_sampler import to_device, unmask_window
from pdllm.shared.generation.sampler import (
    GenerationConfig,
    greedy_predictions,
    step_schedule,
    trim_response,
)
from pdllm.shared.generation.schedule import block_counts


class DeviceDenoiseState:
    """One greedy request's response (``tokens``, on ``device``) with its schedule position on the host;
    the same fields, ``done`` and ``result`` as :class:`~.sampler.DenoiseState`. Advanced by
    :class:`DeviceBatch`."""

    def __init__(
        self,
        config: GenerationConfig,
        mask_id: int,
        eos_id: int | None,
        device: torch.device | str,
    ) -> None:
        config.validate()
        if config.temperature != 0:
            raise ValueError("sampled decoding draws on the host: use DenoiseState")
        self.config, self.mask_id, self.eos_id = config, mask_id, eos_id
        self.device = torch.device(device)
        self._tokens: torch.Tensor | None = None
        self.block = 0
        self.step_in_block = 0
        self.steps_taken = 0
        self.masked = config.block  # masked positions left in the current block
        self._schedule = self._block_schedule()
        self._stopped = False
        self.unmasked: list[list[int]] = []  # tokens unmasked at each step, per block
        # a host copy of the tokens after the last step, in flight until its event completes
        self._host: tuple[torch.Tensor, int, torch.cuda.Event | None] | None = None

    def _block_schedule(self) -> list[int]:
        """The current block's counts per step (unused under a threshold)."""
        if self.config.schedule is not None:
            return block_counts(self.config.schedule, self.block, self.config.block)
        return step_schedule(self.config.block, self.config.steps // self.config.num_blocks)

    @property
    def tokens(self) -> torch.Tensor:
        """The response ids on the device. Made on first use, i.e. on the stream of the first step: the
        request may be started on another stream than the one its steps run on."""
        if self._tokens is None:
            self._tokens = torch.full(
                (self.config.gen_length,), self.mask_id, dtype=torch.long, device=self.device
            )
        return self._tokens

    @property
    def done(self) -> bool:
        return self._stopped or self.block >= self.config.num_blocks

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def by_threshold(self) -> bool:
        return self.config.threshold is not None

    def scheduled(self) -> int:
        """Tokens the next step unmasks (fixed schedule): as :meth:`~.sampler.DenoiseState.apply`."""
        if self.step_in_block == len(self._schedule) - 1:
            return self.masked
        return min(self._schedule[self.step_in_block], self.masked)

    def needs_readback(self) -> bool:
        """Whether only the device can tell where the next step leaves this request."""
        if self.by_threshold:
            return True
        eos_may_stop = self.config.stop_at_eos and self.eos_id is not None
        return eos_may_stop and self.scheduled() == self.masked and self.block < self.config.num_blocks - 1

    def advance(self, masked_left: int, eos_seen: bool) -> None:
        """Account for one step that left ``masked_left`` masked positions in the block; ``eos_seen``: an
        EOS is among the tokens up to this block's end (read only when the block ends)."""
        if self.step_in_block == 0:
            self.unmasked.append([])
        self.unmasked[-1].append(self.masked - masked_left)
        self.steps_taken += 1
        self.step_in_block += 1
        self.masked = masked_left
        if masked_left == 0:
            self.block += 1
            self.step_in_block = 0
            self.masked = self.config.block
            if self.block < self.config.num_blocks:
                self._schedule = self._block_schedule()
            if self.config.stop_at_eos and self.eos_id is not None:
                self._stopped = eos_seen

    def moved(
        self, tokens: torch.Tensor, host: torch.Tensor, start: int, event: torch.cuda.Event | None
    ) -> None:
        """The tokens now live in ``tokens`` (a view of a step's joint buffer); ``host[start:]`` is their
        copy on the host once ``event`` completes."""
        self._tokens = tokens
        self._host = (host, start, event)

    def host_tokens(self) -> list[int]:
        """The response ids now (waits for the device)."""
        if self._host is None:
            return [self.mask_id] * self.config.gen_length if self._tokens is None else self._tokens.tolist()
        host, start, event = self._host
        if event is not None:
            event.synchronize()
        return host[start : start + self.config.gen_length].tolist()

    def result(self) -> list[int]:
        """The response ids, trimmed at the first EOS (and at the first still-masked token)."""
        return trim_response(self.host_tokens(), self.eos_id, self.mask_id)


class DeviceBatch:
    """One denoising step of ``states`` (one model, one device), planned from their host mirrors alone.

    ``row_starts[b]``: where position 0 of ``states[b]``'s response sits among the forward's tokens.
    :attr:`tokens` concatenates the states' current tokens (to place into the forward's input);
    :attr:`rows` (device) lists, state by state, the tokens whose logits the step needs: the masked
    positions of each current block, in order, ``states[b].masked`` of them. :meth:`apply` takes those
    rows' logits, unmasks, and advances every state.
    """

    def __init__(self, states: list[DeviceDenoiseState], row_starts: list[int]) -> None:
        if not states or len(row_starts) != len(states):
            raise ValueError("a device batch needs one row start per state, and at least one state")
        if len({(s.mask_id, s.eos_id) for s in states}) != 1:
            raise ValueError("a device batch needs states of one model (one mask id and EOS id)")
        self.states = states
        self.mask_id, self.eos_id = states[0].mask_id, states[0].eos_id
        device = states[0].device
        width = max(s.config.block for s in states)
        starts = [0]
        for s in states:
            starts.append(starts[-1] + s.config.gen_length)
        scratch = starts[-1]  # one slot past the tokens: window padding reads and writes only there
        window, sel, add, slot_base, eos_at = [], [], [], [], []
        for b, s in enumerate(states):
            lo = starts[b] + s.block * s.config.block
            window += [lo + j if j < s.config.block else scratch for j in range(width)]
            sel += [b * width + j for j in range(s.masked)]
            add += [row_starts[b] + s.block * s.config.block] * s.masked
            slot_base += [b * width] * s.masked
            eos_at += [starts[b], starts[b] + (s.block + 1) * s.config.block]
        k = [0 if s.by_threshold else s.scheduled() for s in states]
        by_threshold = [int(s.by_threshold) for s in states]
        # every index of the step in one upload
        parts = [window, sel, add, slot_base, eos_at, k, by_threshold]
        ints = to_device([i for part in parts for i in part], torch.long, device)
        self._window_at, sel_t, add_t, base_t, self._eos_at, self._k, use = ints.split(
            [len(x) for x in parts]
        )
        self._use_threshold = use.bool()
        if any(by_threshold):
            self._threshold = to_device([s.config.threshold or 0.0 for s in states], torch.float32, device)
        else:
            self._threshold = torch.zeros(len(states), dtype=torch.float32, device=device)
        self._starts, self._k_host = starts, k
        pad = torch.full((1,), -1, dtype=torch.long, device=device)  # never [MASK]: never unmasked
        self._flat = torch.cat([*(s.tokens for s in states), pad])
        self.tokens = self._flat[:scratch]
        self._window = self._flat[self._window_at].view(len(states), width)
        slots = torch.arange(width, device=device)
        masked = self._window == self.mask_id
        # masked slots first, each group in slot order: the first `masked` entries are the masked positions
        order = torch.argsort(torch.where(masked, slots, slots + width), dim=-1)
        position = order.flatten()[sel_t]
        self.rows = position + add_t
        self._slot = position + base_t  # flat index into the [B, width] windows

    def apply(self, logits: torch.Tensor) -> None:
        """Unmask from ``logits`` of :attr:`rows` (``[len(rows), V]``) and advance every state; reads the
        device back (one copy) only if a state needs it (:meth:`DeviceDenoiseState.needs_readback`)."""
        shape = self._window.shape
        confidence, predicted = greedy_predictions(logits, self.mask_id)
        conf_win = torch.full((shape.numel(),), -1.0, dtype=torch.float32, device=logits.device)
        conf_win.index_put_((self._slot,), confidence)
        pred_win = torch.full_like(self._window.view(-1), self.mask_id).index_put_((self._slot,), predicted)
        new = unmask_window(
            self._window,
            conf_win.view(shape),
            pred_win.view(shape),
            self._k,
            self._threshold,
            self._use_threshold,
            self.mask_id,
        )
        # padding slots all point at the scratch slot and write back its own value
        self._flat.index_copy_(0, self._window_at, new.view(-1))
        readback = [s.needs_readback() for s in self.states]
        left: list[int] = [s.masked - k for s, k in zip(self.states, self._k_host, strict=True)]
        seen = [False] * len(self.states)
        if any(readback):
            eos_id = self.eos_id
            left_now = (new == self.mask_id).sum(-1)
            eos = torch.zeros_like(left_now)
            if eos_id is not None:
                # EOS count up to each block's end: differences of one running count over all tokens
                hits = torch.cat([self._flat.new_zeros(1), (self._flat == eos_id).long().cumsum(0)])
                ends = hits[self._eos_at].view(-1, 2)
                eos = ends[:, 1] - ends[:, 0]
            host = torch.stack([left_now, eos]).tolist()
            for b, s in enumerate(self.states):
                if readback[b]:
                    left[b] = host[0][b] if s.by_threshold else left[b]
                    seen[b] = host[1][b] > 0
        snapshot = self._flat.to("cpu", non_blocking=True)
        event = None
        if self._flat.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for b, s in enumerate(self.states):
            s.moved(self.tokens[self._starts[b] : self._starts[b + 1]], snapshot, self._starts[b], event)
            s.advance(left[b], seen[b])
