"""FOCUS's reference loop on SDAR (``decode_service/policies/focus.py`` says what the method does): one
request, its own per-layer loop over the model's modules.

:class:`FocusReference` is one request's step, plainly: layers 0-1 over every unfrozen row, the delta and
selection (:func:`importance`, :func:`select`: Eq. 2-5 and Algorithm 1 line by line, in Python sets), layers
>= 2 over the selected rows, the LM head over the eligible rows only (:func:`eligible_rows`). It runs inside
block diffusion's block loop (its ``step`` hook, :func:`focus_block_step`: the window over the exact cache
of the earlier blocks), :class:`FocusBlockSession` (run to the end by :func:`generate_focus_block_diffusion`
and ``tests/reference/sdar.py``), over the whole prompt (vanilla) or over pdllm's block-causal prefix of the
selected chunks (``decode_service/sdar_decode.py``).

The decode worker and the engine run FOCUS in the batched rounds (``decode_service/sdar_focus_rounds.py``),
held to these loops token for token and counter for counter.

Layer 1 runs whole on every unfrozen row (the paper finishes it on the selected rows only, Algorithm 1
line 21: the same values for them); the counters report layers >= 2, as the paper's Table 5 does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdllm.decode_service.block_diffusion import PREFILL_PIECE_TOKENS, BlockKVCache
from pdllm.decode_service.policies.focus import FocusConfig, FocusMemory, FocusStats, check_model
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.block_diffusion import BlockDiffusionSession, BlockStep, run_to_end
from tests.reference.focus_layers import BlockKV, RowsAttention, SdarRows, keys_in_row_order


def _ceil_count(value: float) -> int:
    """Rows a replayed share forces: ``value`` rounded up, after rounding away float noise below
    1e-6 (``0.7 * 10`` is 7 rows); written here, not imported, so the oracle shares no helper."""
    return math.ceil(round(value, 6))


def budget(
    config: FocusConfig, k_hist: int, n_sigma: int, block_length: int, quota: int | None, rows: int
) -> int:
    """Eq. 4's K (or the fixed ``budget``; or ``ceil(f x rows)``, at least 1, for a replayed retained share
    f of the block's ``rows``), raised to the fixed schedule's ``quota`` of this step."""
    if config.replay_retained_frac is not None:
        k = max(1, _ceil_count(config.replay_retained_frac * rows))
    else:
        k = config.budget if config.budget is not None else min(block_length, max(k_hist, n_sigma))
    return k if quota is None else max(k, quota)


def importance(q: torch.Tensor, k: torch.Tensor, kernel: int) -> torch.Tensor:
    """Eq. 2 for one request: ``I_j`` ``[B]`` (float64) of the block's ``B`` key rows ``k`` ``[Hkv, B, D]``
    from its query rows ``q`` ``[Hq, n, D]`` (query head h reads KV head h // (Hq / Hkv)). MaxPool1D runs
    over the keys (stride 1, -inf padding: an edge key pools over its real neighbours only). Float64, so a
    different summation order (the fast path's) cannot flip a selection."""
    heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[2]
    keys = k.double().repeat_interleave(heads // kv_heads, dim=0)
    scores = q.double() @ keys.transpose(1, 2) / math.sqrt(dim)  # [Hq, n, B]
    if kernel > 1:
        b = scores.shape[-1]
        scores = F.max_pool1d(scores.reshape(-1, 1, b), kernel, 1, kernel // 2).reshape(scores.shape)
    return torch.softmax(scores, dim=-1).sum(dim=(0, 1))


@dataclass(frozen=True)
class Selection:
    """One step's choice over the block's rows: ``rows`` forwarded past layer 1 (ascending), ``top`` the
    K focused masked rows, ``reach`` the new visible prefix at layers >= 2, and Eq. 5's ``n_sigma``."""

    rows: list[int]
    top: list[int]
    reach: int
    n_sigma: int


def select(
    delta: torch.Tensor, memory: FocusMemory, config: FocusConfig, block_length: int, quota: int | None
) -> Selection:
    """Algorithm 1 lines 7-18 over the block's rows, written out (the reference)."""
    d = delta.tolist()
    masked = [r for r, m in enumerate(memory.masked) if m]
    mean = sum(d) / len(d)
    sigma = math.sqrt(sum((x - mean) ** 2 for x in d) / len(d))
    n_sigma = sum(1 for j in masked if d[j] >= sigma)  # Eq. 5
    k = budget(config, memory.k_hist(config.alpha), n_sigma, block_length, quota, len(d))
    top = sorted(masked, key=lambda j: (-d[j], j))[:k]
    chosen = set(top) | {i - 1 for i in top if i > 0}  # AR-context preservation (line 17)
    last = max(chosen)
    chosen |= {j for j in masked if memory.reach <= j < last}  # placeholder integrity (line 18)
    # Decoded rows stay (context); frozen ones are read from their cached K/V instead.
    chosen |= {r for r, m in enumerate(memory.masked) if not m and not memory.frozen[r]}
    rows = sorted(chosen)
    return Selection(rows, sorted(top), max(memory.reach, rows[-1] + 1), n_sigma)


def eligible_rows(rows: list[int], masked: list[bool]) -> list[int]:
    """Masked block rows the sampler may unmask: the forwarded ones (SDAR's logits are unshifted: row j's
    come from row j)."""
    return [j for j in rows if masked[j]]


@dataclass
class _Layers:
    """The attention of one phase of one request's step: the forwarded block rows ``fresh`` (block rows,
    ascending) are written into the store; the keys are the forwarded rows around the block and the
    block's rows ``[0, visible)`` from the store. ``capture``: keep layers 0-1's q and block keys."""

    store: BlockKV
    before: int
    fresh: torch.Tensor
    visible: int
    attend: AttentionBackend
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.before, self.fresh.numel()
        self.store.write(layer, self.fresh, k[:, :, b : b + n], v[:, :, b : b + n])
        kb, vb = self.store.block(layer, 0)
        if self.capture is not None:
            self.capture[layer] = (q[0, :, b : b + n], kb[0, :, : self.visible])
        ks = keys_in_row_order(k, kb, b, n, self.visible)
        vs = keys_in_row_order(v, vb, b, n, self.visible)
        return self.attend(layer, q, ks, vs)


class FocusReference:
    """One request's FOCUS steps (the reference). Call :meth:`start` with the current block, :meth:`step`
    for its logits, then :meth:`observe` with the block rows the sampler unmasked."""

    def __init__(self, model: DiffusionLM, focus: FocusConfig, block_length: int) -> None:
        self.model, self.focus, self.block_length = model, focus, block_length
        self.memory = FocusMemory()
        self.stats = FocusStats()
        self.store = BlockKV(model, 1, block_length)
        self._reach = 0

    def start(self, block: int, block_tokens: torch.Tensor) -> None:
        """Begin block ``block`` (a no-op while it is the current one)."""
        if block != self.memory.block:
            masked = (block_tokens == self.model.config.mask_token_id).tolist()
            self.memory.start_block(block, masked, self.focus.delayed_cache)

    @torch.inference_mode()
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        lo: int,
        hi: int,
        at: torch.Tensor,
        attention: RowsAttention,
        quota: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[n, V]`` of the local rows ``at`` (the block's masked rows, ascending) and which of them
        the sampler may unmask (bool, host); rows ``[lo, hi)`` of ``tokens`` / ``positions`` are the
        block, the others context. Ineligible rows' logits are zeros (never computed)."""
        model, mem, dev = self.model, self.memory, tokens.device
        total, width = tokens.numel(), hi - lo
        at_rows = (at - lo).tolist()
        if at_rows != [r for r, m in enumerate(mem.masked) if m]:
            raise RuntimeError("FOCUS's block state disagrees with the sampler's masked positions")
        active = [r for r in range(width) if not mem.frozen[r]]
        rows0 = [*range(lo), *(lo + r for r in active), *range(hi, total)]
        idx0 = torch.tensor(rows0, device=dev)
        x, cos, sin = model.embed(tokens[idx0][None], positions[idx0][None])
        captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        fresh0 = torch.tensor(active, device=dev)
        attend0 = attention(idx0, torch.arange(total, device=dev))
        phase0 = _Layers(self.store, lo, fresh0, width, attend0, captured)
        for layer in model.model.layers[:2]:
            x = layer(x, cos, sin, phase0)
        kernel = self.focus.pool_kernel
        delta = importance(*captured[1], kernel) - importance(*captured[0], kernel)
        sel = select(delta, mem, self.focus, self.block_length, quota)
        if not set(range(mem.reach, sel.reach)) <= set(sel.rows):
            raise RuntimeError("placeholder integrity broken: a newly visible row was never forwarded")

        rows1 = [*range(lo), *(lo + r for r in sel.rows), *range(hi, total)]
        where0 = {r: i for i, r in enumerate(rows0)}
        keep = torch.tensor([where0[r] for r in rows1], device=dev)
        x, cos, sin = x[:, keep], cos[:, keep], sin[:, keep]
        keys1 = [*range(lo + sel.reach), *range(hi, total)]
        attend1 = attention(torch.tensor(rows1, device=dev), torch.tensor(keys1, device=dev))
        phase1 = _Layers(self.store, lo, torch.tensor(sel.rows, device=dev), sel.reach, attend1)
        for layer in model.model.layers[2:]:
            x = layer(x, cos, sin, phase1)
        hidden = model.model.norm(x)

        eligible = eligible_rows(sel.rows, mem.masked)
        where1 = {r: i for i, r in enumerate(rows1)}
        src = torch.tensor([where1[lo + j] for j in eligible], device=dev)
        computed = model.lm_head(hidden[:, src])[0]
        slot = {r: i for i, r in enumerate(at_rows)}
        rows_at = torch.tensor([slot[j] for j in eligible], device=dev)
        logits = computed.new_zeros(len(at_rows), computed.shape[-1]).index_copy_(0, rows_at, computed)
        mask = torch.zeros(len(at_rows), dtype=torch.bool)
        mask[rows_at.cpu()] = True

        deep = model.config.num_layers - 2
        kept = sum(1 for r in sel.rows if mem.masked[r])
        s = self.stats
        s.forwards += 1
        s.rows_forwarded += len(rows1) * deep
        s.rows_plain += total * deep
        s.rows_prefix += len(rows0) * 2
        s.focused += kept
        s.evicted += len(at_rows) - kept
        s.frozen += width - len(active)
        self._reach = sel.reach
        return logits, mask

    def observe(self, picked: list[int]) -> None:
        """The sampler unmasked block rows ``picked`` after the last :meth:`step`."""
        self.memory.observe(picked, self._reach, self.focus.delayed_cache)
        self.stats.decoded += len(picked)

    def summary(self) -> dict[str, int | str]:
        """``{"policy": "focus", counters}``: ``GenerationResult.cache``."""
        return {"policy": self.focus.name, **self.stats.as_dict()}


def focus_block_step(reference: FocusReference, prompt_length: int) -> BlockStep:
    """FOCUS's denoising step of an SDAR block (a :data:`~tests.reference.block_diffusion.BlockStep`): ``reference``'s
    step over the window against the exact cache of the earlier blocks, the sampler unmasking among the
    eligible rows only, which ``reference`` then observes."""
    block_size = reference.model.config.block_size
    assert block_size is not None, "FOCUS's block step needs a block-diffusion model"

    def step(
        state: DenoiseState,
        window: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        cache: BlockKVCache,
    ) -> None:
        reference.start(state.block, window)
        attention = SdarRows(cache, positions, block_size)
        logits, eligible = reference.step(
            window, positions, 0, window.numel(), rows, attention, state.quota()
        )
        picked = state.update(logits, eligible)
        reference.observe((picked + (prompt_length - int(positions[0]))).tolist())

    return step


class FocusBlockSession(BlockDiffusionSession):
    """SDAR under FOCUS, one denoising step per :meth:`step`: a :class:`BlockDiffusionSession` whose block
    step is FOCUS's (:func:`focus_block_step`); its result's ``cache`` holds FOCUS's counters. ``prefix``:
    as the plain session's (pdllm's block-causal cache of ``[instruction, selected chunks]``,
    ``decode_service/sdar_decode.py``). It runs to the end in ``block_diffusion.run_to_end`` (vanilla's
    :func:`generate_focus_block_diffusion`, pdllm's ``sdar.decode``)."""

    def __init__(
        self,
        model: DiffusionLM,
        prompt: torch.Tensor,
        config: GenerationConfig,
        focus: FocusConfig,
        prefill_piece: int = PREFILL_PIECE_TOKENS,
        prefix: BlockKVCache | None = None,
    ) -> None:
        check_model(model)
        with torch.inference_mode():  # its block store, as the session's cache, holds inference tensors
            self.reference = FocusReference(model, focus, config.block)
        step = focus_block_step(self.reference, prompt.numel())
        super().__init__(model, prompt, config, prefill_piece, step=step, prefix=prefix)

    def result(self) -> GenerationResult:
        result = super().result()
        result.cache = self.reference.summary()
        return result


@torch.inference_mode()
def generate_focus_block_diffusion(
    model: DiffusionLM,
    prompt: torch.Tensor,
    config: GenerationConfig,
    focus: FocusConfig,
    progress: bool = False,
    prefix: BlockKVCache | None = None,
) -> GenerationResult:
    """SDAR under FOCUS: ``generate_block_diffusion`` with FOCUS's step over each block's window (a
    :class:`FocusBlockSession` to the end)."""
    session = FocusBlockSession(model, prompt, config, focus, prefix=prefix)
    return run_to_end(session, config, progress)
