"""The shared unmasking logic of masked-diffusion decoding.

Every decoder — vanilla, Prefilling-dLLM, and the decode policies — differs only in
how it computes logits for the masked response positions. What to unmask next is decided here, once:
:class:`DenoiseState` holds one request's response tokens and steps through semi-autoregressive blocks,
either with LLaDA/Dream's fixed schedule (low-confidence remasking: the top-k most confident predictions
are kept per step), with Fast-dLLM's confidence threshold (all predictions above tau, at least one), or
replaying a recorded schedule (``GenerationConfig.schedule``: the top-k with k as recorded, ``schedule.py``).
Every state records the tokens each step unmasked (``unmasked``, per block).
:func:`denoise` is the loop that drives a state with any logits function. A decode policy that computes
the logits of only some positions (FOCUS, ``decode_service/policies/focus*.py``) passes ``eligible`` to
:meth:`DenoiseState.update`: the same rule then chooses among those positions only.

This CPU-steppable state is the specification; ``device_sampler`` runs the same decision as device ops
(greedy only) and is tested token for token against it. Ties in confidence go to the lower position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from tqdm import tqdm

from pdllm.shared.generation.schedule import Schedule, block_counts, check_schedule
from pdllm.shared.settings import GenerationSettings, validate

_DEFAULTS = GenerationSettings()


@dataclass(frozen=True)
class GenerationConfig:
    """The generation settings (``settings.GenerationSettings``: defaults, bounds, help) as the sampler runs
    them: ``steps`` is always set. Checked by :meth:`validate`, which every decoder calls."""

    gen_length: int = _DEFAULTS.gen_length
    steps: int = _DEFAULTS.gen_length
    # None: one block spanning the whole response.
    block_length: int | None = _DEFAULTS.block_length
    # None: fixed schedule (steps); else unmask every prediction with confidence > threshold (>= 1 per step).
    threshold: float | None = _DEFAULTS.threshold
    # 0: greedy. Otherwise sample from softmax(logits / temperature) with a generator seeded by `seed`.
    temperature: float = _DEFAULTS.temperature
    seed: int = _DEFAULTS.seed
    # Stop after the block in which an EOS was produced; the result is trimmed at the first EOS.
    stop_at_eos: bool = True
    # None: ``steps`` or ``threshold`` decide. Else a replay: step i of block b unmasks exactly
    # ``schedule[b][i]`` tokens, fitted to the block (``schedule.block_counts``). An in-process setting
    # (eval, benchmarks): no request or settings schema carries it.
    schedule: Schedule | None = None

    @property
    def block(self) -> int:
        return self.block_length or self.gen_length

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block

    def validate(self) -> None:
        """Raise a ``settings.SettingError`` (a ValueError) naming the first setting the schema refuses."""
        values = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name in GenerationSettings.model_fields
        }
        validate(GenerationSettings, values)
        if self.schedule is not None:
            if self.threshold is not None:
                raise ValueError("a replayed schedule decides every step's count: set no threshold with it")
            check_schedule(self.schedule)


def step_schedule(block_length: int, steps_per_block: int) -> list[int]:
    """Tokens to unmask at each step of a block: as even as possible, earlier steps take the remainder.

    More steps than tokens would only add forwards that unmask nothing, so steps are capped at the
    block length.
    """
    steps = min(steps_per_block, block_length)
    base, rem = divmod(block_length, steps)
    return [base + 1 if i < rem else base for i in range(steps)]


def uniform_spans(config: GenerationConfig) -> list[tuple[int, int]]:
    """The response's semi-autoregressive blocks, ``config.block`` tokens each: ``[lo, hi)`` per block."""
    return [(b * config.block, (b + 1) * config.block) for b in range(config.num_blocks)]


def _check_spans(spans: list[tuple[int, int]], gen_length: int) -> None:
    ends = [0] + [hi for _, hi in spans]
    tiled = all(lo == end and lo < hi for (lo, hi), end in zip(spans, ends))
    if not spans or not tiled or ends[-1] != gen_length:
        raise ValueError(f"block spans {spans} do not tile the response [0, {gen_length}) in order")


class DenoiseState:
    """One request's response under iterative unmasking (response-relative positions 0..gen_length-1).

    ``spans``: the blocks, decoded in order (default :func:`uniform_spans`). Block diffusion (SDAR) aligns
    its blocks to absolute positions, so its first and last answer blocks may be shorter; each block gets
    ``config.steps // config.num_blocks`` steps, capped at its length, like a uniform block does.
    """

    def __init__(
        self,
        config: GenerationConfig,
        mask_id: int,
        eos_id: int | None,
        device: torch.device | str = "cpu",
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.tokens = torch.full((config.gen_length,), mask_id, dtype=torch.long, device=device)
        self.spans = uniform_spans(config) if spans is None else list(spans)
        _check_spans(self.spans, config.gen_length)
        self.block = 0
        self.step_in_block = 0
        self.steps_taken = 0
        self._steps_per_block = config.steps // config.num_blocks
        self._schedule = self._block_schedule()
        self.generator = torch.Generator().manual_seed(config.seed)
        self._stopped = False
        # tokens unmasked at each step, per block (what ``--record-schedule`` writes)
        self.unmasked: list[list[int]] = []

    def _span_length(self) -> int:
        lo, hi = self.spans[self.block]
        return hi - lo

    def _block_schedule(self) -> list[int]:
        """The current block's counts per step (unused under a threshold)."""
        if self.config.schedule is not None:
            return block_counts(self.config.schedule, self.block, self._span_length())
        return step_schedule(self._span_length(), self._steps_per_block)

    @property
    def done(self) -> bool:
        return self._stopped or self.block >= len(self.spans)

    @property
    def num_blocks(self) -> int:
        """Blocks of the response (block diffusion's aligned spans may be one more than the config's)."""
        return len(self.spans)

    def positions(self) -> torch.Tensor:
        """Masked positions of the current block: the rows the next logits must cover, in order."""
        lo, hi = self.spans[self.block]
        return (self.tokens[lo:hi] == self.mask_id).nonzero().flatten() + lo

    def update(self, logits: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
        """Apply one step's logits (``[len(positions()), V]``); returns the newly unmasked positions.
        ``eligible``: see :meth:`apply`."""
        return self.apply(*predict_many(logits, [self], [logits.shape[0]])[0], eligible)

    def quota(self) -> int | None:
        """How many positions the next step unmasks under the fixed schedule (None under a confidence
        threshold, where the confidences decide). A caller that lets only some positions be unmasked
        (``eligible``: FOCUS's eviction) keeps at least this many eligible, so the schedule is kept."""
        if self.config.threshold is not None:
            return None
        n = int(self.positions().shape[0])
        if self.step_in_block >= len(self._schedule) - 1:
            return n
        return min(self._schedule[self.step_in_block], n)

    def apply(
        self, tokens: torch.Tensor, confidence: torch.Tensor, eligible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Apply one step's predictions for :meth:`positions` (from :func:`predict_many`); returns the newly
        unmasked positions. ``eligible`` (bool per position, optional): only those may be unmasked this
        step (a decode policy that did not compute the others, FOCUS); the choice is made among them by
        the same rule (the schedule's count capped at their number, or the threshold, else their most
        confident). None: every position may be, as always."""
        positions = self.positions()
        if tokens.shape[0] != positions.shape[0]:
            raise ValueError(f"expected logits for {positions.shape[0]} positions, got {tokens.shape[0]}")
        tokens, confidence = tokens.to(self.tokens.device), confidence.to(self.tokens.device)
        allowed = positions.shape[0]
        if eligible is not None:
            eligible = eligible.to(device=confidence.device, dtype=torch.bool)
            if eligible.shape != confidence.shape or not bool(eligible.any()):
                raise ValueError(f"eligible must mark >= 1 of the {positions.shape[0]} positions")
            # -inf never passes a threshold, never wins the argmax, and sorts after every eligible row.
            confidence = confidence.masked_fill(~eligible, float("-inf"))
            allowed = int(eligible.sum())
        if self.config.threshold is None:
            # ``>=``: with ``eligible`` a block may outlast its schedule; the extra steps act as its last.
            last = self.step_in_block >= len(self._schedule) - 1
            k = positions.shape[0] if last else min(self._schedule[self.step_in_block], positions.shape[0])
            k = min(k, allowed)
            # A stable sort, not topk: topk's tie order is implementation-defined (it differs between CPU
            # and CUDA and between sizes), and the device path must reproduce this choice exactly.
            chosen = torch.sort(confidence, descending=True, stable=True).indices[:k]
        else:
            chosen = (confidence > self.config.threshold).nonzero().flatten()
            if chosen.numel() == 0:
                chosen = confidence.argmax().view(1)
        picked = positions[chosen]
        self.tokens[picked] = tokens[chosen]
        if self.step_in_block == 0:
            self.unmasked.append([])
        self.unmasked[-1].append(int(picked.numel()))
        self.steps_taken += 1
        self.step_in_block += 1
        lo, hi = self.spans[self.block]
        if not bool((self.tokens[lo:hi] == self.mask_id).any()):
            self._finish_block()
        return picked

    def _finish_block(self) -> None:
        end = self.spans[self.block][1]
        self.block += 1
        self.step_in_block = 0
        if self.block < len(self.spans):
            self._schedule = self._block_schedule()
        if self.config.stop_at_eos and self.eos_id is not None:
            self._stopped = bool((self.tokens[:end] == self.eos_id).any())

    def result(self) -> list[int]:
        """The response ids, trimmed at the first EOS (and at the first still-masked token)."""
        return trim_response(self.tokens.tolist(), self.eos_id, self.mask_id)


def trim_response(tokens: list[int], eos_id: int | None, mask_id: int) -> list[int]:
    """``tokens`` up to (not including) the first EOS or still-masked slot."""
    out: list[int] = []
    for t in tokens:
        if t in (eos_id, mask_id):
            break
        out.append(t)
    return out


def greedy_predictions(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, token) per row of ``logits``, on its device: the most probable token other than
    [MASK] and its softmax probability in float32. Row-wise, so any subset of rows gives the same values."""
    logits = logits.to(torch.float32, copy=True)
    # Predicting [MASK] would leave the position masked and stall the schedule.
    logits[:, mask_id] = float("-inf")
    return torch.softmax(logits, dim=-1).max(dim=-1)


def _sampling_probs(logits: torch.Tensor, mask_id: int, temperature: float) -> torch.Tensor:
    logits = logits.to(torch.float32, copy=True)
    logits[:, mask_id] = float("-inf")
    return torch.softmax(logits / temperature, -1)


def predict_many(
    logits: torch.Tensor, states: list[DenoiseState], counts: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Predicted token and its probability for each row of ``logits``, which stacks ``counts[i]`` rows for
    ``states[i]`` (the rows of its :meth:`~DenoiseState.positions`): greedy, or sampled at the state's
    temperature with its own generator on the CPU (seeds reproduce across devices). The rows of all states
    are reduced in one pass and reach the host in one copy (one more for all sampled rows), so a round
    over many requests costs no device sync per request; a single state is the same call with one entry.
    Returns (tokens, confidence) on the CPU per state."""
    if not states:
        return []
    mask_ids = {s.mask_id for s in states}
    if len(mask_ids) != 1:
        raise ValueError("predict_many needs states of one model (one mask id)")
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    if bounds[-1] != logits.shape[0]:
        raise ValueError(f"counts add up to {bounds[-1]} rows, logits have {logits.shape[0]}")
    mask_id = mask_ids.pop()
    confidence, tokens = greedy_predictions(logits, mask_id)
    # one copy: vocabulary ids are exact in float32 (< 2**24)
    host = torch.stack([confidence, tokens.to(torch.float32)]).cpu()
    out = [(host[1, a:b].long(), host[0, a:b]) for a, b in zip(bounds, bounds[1:])]
    sampled = [i for i, s in enumerate(states) if s.config.temperature != 0]
    if sampled:
        probs = torch.cat(
            [
                _sampling_probs(logits[bounds[i] : bounds[i + 1]], mask_id, states[i].config.temperature)
                for i in sampled
            ]
        ).cpu()
        row = 0
        for i in sampled:
            p = probs[row : row + counts[i]]
            row += counts[i]
            drawn = torch.multinomial(p, 1, generator=states[i].generator).flatten()
            out[i] = (drawn, p.gather(-1, drawn[:, None]).flatten())
    return out


@dataclass
class GenerationResult:
    token_ids: list[int]
    raw_tokens: list[int]
    steps: int
    decode_seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    # A decode policy's name and counters (``decode_service/policies/base.CacheStats``); empty without one.
    cache: dict[str, int | str] = field(default_factory=dict)
    # Tokens unmasked at each step, per block (``DenoiseState.unmasked``).
    unmasked: list[list[int]] = field(default_factory=list)


LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(response tokens [G], positions to predict [n]) -> logits [n, V]."""


class DenoiseSession:
    """A :class:`DenoiseState` bound to its logits function, advanced one step at a time.

    :func:`denoise` runs one to completion (the reference loops; the decode worker advances its requests
    together in ``decode_service.rounds``, not through this class).
    """

    def __init__(
        self,
        config: GenerationConfig,
        mask_id: int,
        eos_id: int | None,
        logits_fn: LogitsFn,
        device: torch.device | str = "cpu",
    ) -> None:
        self.state = DenoiseState(config, mask_id, eos_id, device)
        self.logits_fn = logits_fn
        self.device = torch.device(device)
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return self.state.done

    def step(self) -> torch.Tensor:
        """One denoising step; returns the response positions it unmasked."""
        start = time.perf_counter()
        picked = self.state.update(self.logits_fn(self.state.tokens, self.state.positions()))
        self.seconds += time.perf_counter() - start
        return picked

    def result(self) -> GenerationResult:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return GenerationResult(
            token_ids=self.state.result(),
            raw_tokens=self.state.tokens.tolist(),
            steps=self.state.steps_taken,
            decode_seconds=self.seconds,
            unmasked=[list(b) for b in self.state.unmasked],
        )


def denoise(
    config: GenerationConfig,
    mask_id: int,
    eos_id: int | None,
    logits_fn: LogitsFn,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> GenerationResult:
    """Drive one :class:`DenoiseSession` to completion with ``logits_fn``."""
    session = DenoiseSession(config, mask_id, eos_id, logits_fn, device)
    total = config.gen_length if config.threshold is not None else min(config.steps, config.gen_length)
    with tqdm(total=total, disable=not progress, delay=1.0, desc="denoise", unit="step", leave=False) as bar:
        while not session.done:
            session.step()
            bar.update(1)
    return session.result()
