"""Losses: masked diffusion (MDLM/LLaDA, 1/t weighted), block diffusion (SDAR / BD3-LM, for models with a
``block_size``) and next-token prediction under a causal mask.

Masked diffusion masks a row's loss region at one ratio; rows with ``Batch.block_bounds`` (``data.py``'s
``block_mask_share``) get a block decoder's mask instead (:func:`mask_for_block_decoding`).

Block diffusion, the two-stream form of BD3-LM: the model reads ``[noisy row ; clean row]`` (``2T`` tokens,
both halves at positions ``0..T-1``, so blocks ``p // block_size`` are aligned to absolute position 0 as the
decode path aligns them: ``decode_service/block_diffusion.py``, ``model/sdar.py``) under
:func:`block_diffusion_mask`: a noisy token attends to the noisy tokens of its own block (bidirectionally)
and to the clean tokens of earlier blocks; a clean token attends block-causally to clean tokens. Each noisy
block is therefore denoised exactly as a generation block is decoded (earlier blocks finished, i.e. their
clean K/V cached; the block itself partly masked; later blocks absent), and every block of a row is trained
in one forward. The noise level is drawn per block (stratified within a row, ``mask_for_blocks``), and only
positions of the batch's loss region are masked, so in an answer-only row the prompt tokens that share the
answer's first block stay clean, as the decode path keeps them (it decodes the prompt's last partial block
together with the first answer tokens). Logits are unshifted (SDAR: a masked position predicts its own
token) and read from the noisy half only; the weight is ``1 / (p_block * |loss region of the row|)``, the
masked-diffusion ELBO per block. ``chunk`` rows are trained in this layout too, without their chunk mask:
SDAR decodes over a contiguous prompt block-causally (``decode_service/sdar_decode.py``). ``causal`` rows
stay next-token prediction under a causal mask, read from the previous position, as the prefill scorer
(``prefill_service/scoring.py``) reads every model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.attention import DenseAttention
from ..model.transformer import DiffusionLM
from .data import Batch, chunk_attention_mask


@dataclass
class LossOutput:
    loss: torch.Tensor  # the scalar to minimise
    ce: torch.Tensor  # plain mean cross-entropy over predicted tokens (comparable across modes)
    answer_correct: torch.Tensor  # predicted answer-region tokens that were argmax-correct
    answer_total: torch.Tensor


def mask_for_diffusion(
    region: torch.Tensor, eps: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw t ~ U(0, 1) per row and mask each region position with p = (1 - eps) t + eps.

    Returns (masked [B, T] bool, p [B]). Every row with a non-empty region gets at least one masked
    position, so no row contributes an empty (undefined) term.
    """
    b, t = region.shape
    device = region.device
    # Stratified t (one uniform offset, rows spread evenly over [0, 1)): same expectation, lower variance.
    u = torch.rand(1, generator=generator, device=device)
    t_row = (u + torch.arange(b, device=device) / b) % 1.0
    p = (1.0 - eps) * t_row + eps
    masked = (torch.rand(b, t, generator=generator, device=device) < p[:, None]) & region
    empty = ~masked.any(dim=1) & region.any(dim=1)
    if bool(empty.any()):
        # Rows with nothing masked get one random region position.
        scores = torch.rand(b, t, generator=generator, device=device).masked_fill(~region, -1.0)
        pick = scores.argmax(dim=1)
        masked[empty, pick[empty]] = True
    return masked, p


def mask_for_block_decoding(
    region: torch.Tensor, bounds: torch.Tensor, eps: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-decoding masks for rows with ``bounds`` (``Batch.block_bounds``), one-ratio masks for the rest.

    A row with bounds ``[start, end)``: its region before ``start`` is clean and unscored, the block is
    masked at the row's ratio (:func:`mask_for_diffusion`'s draw, at least one masked token), the region
    from ``end`` on is masked. Returns (masked [B, T], scored region [B, T], p [B, T]: each scored
    position's masking probability; 1 after the block).
    """
    pos = torch.arange(region.shape[1], device=region.device)[None]
    start, end = bounds[:, :1], bounds[:, 1:]
    planned = start >= 0
    after = region & planned & (pos >= end)
    scored = region & ~(planned & (pos < start))
    masked, p_row = mask_for_diffusion(scored & ~after, eps, generator)
    p = torch.where(after, torch.ones_like(p_row)[:, None], p_row[:, None])
    return masked | after, scored, p


def mask_for_blocks(
    region: torch.Tensor, block_size: int, eps: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block diffusion's noise: a level t per block (``position // block_size``), each region position of
    the block masked with p = (1 - eps) t + eps.

    The levels of a row's blocks are stratified (one uniform offset per row, the blocks spread evenly over
    [0, 1) in a random order). Returns (masked [B, T] bool, p [B, T]: each position's block level). Every
    row with a non-empty region gets at least one masked position.
    """
    b, t = region.shape
    device = region.device
    n_blocks = -(-t // block_size)
    u = torch.rand(b, 1, generator=generator, device=device)
    order = torch.rand(b, n_blocks, generator=generator, device=device).argsort(dim=1)
    t_block = (u + order / n_blocks) % 1.0
    p = ((1.0 - eps) * t_block + eps).repeat_interleave(block_size, dim=1)[:, :t]
    masked = (torch.rand(b, t, generator=generator, device=device) < p) & region
    empty = ~masked.any(dim=1) & region.any(dim=1)
    if bool(empty.any()):
        scores = torch.rand(b, t, generator=generator, device=device).masked_fill(~region, -1.0)
        pick = scores.argmax(dim=1)
        masked[empty, pick[empty]] = True
    return masked, p


def block_diffusion_mask(t: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``[1, 1, 2T, 2T]`` (True = may attend) over ``[noisy ; clean]``, both at positions ``0..T-1``:
    noisy -> noisy of the same block, noisy -> clean of earlier blocks, clean -> clean of this or earlier
    blocks; clean never sees noisy."""
    blk = torch.arange(t, device=device) // block_size
    q, k = blk[:, None], blk[None, :]
    noisy = torch.cat([q == k, k < q], dim=1)
    clean = torch.cat([torch.zeros(t, t, dtype=torch.bool, device=device), k <= q], dim=1)
    return torch.cat([noisy, clean], dim=0)[None, None]


@dataclass
class MaskedAttention:
    """Attention under a boolean ``[1, 1, T, T]`` mask with the K/V heads repeated to the query heads first.

    The same values as :class:`~..model.attention.DenseAttention` with that mask. SDPA runs grouped-query
    attention only in its flash kernel (no mask) and its math kernel (fp32 scores ``[B, H, T, T]`` kept for
    the backward: tens of GB for a 2T = 2176-token two-stream batch); with the heads repeated, a masked SDPA
    can take the memory-efficient kernel instead."""

    mask: torch.Tensor

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def block_diffusion_hidden(
    model: DiffusionLM, ids: torch.Tensor, masked: torch.Tensor, mask_id: int
) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` of the noisy half: ``ids`` with ``masked`` positions set to ``mask_id``,
    each block given the clean tokens of the earlier blocks (the two-stream forward; see the module)."""
    b, t = ids.shape
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    pos = torch.arange(t, device=ids.device)
    positions = torch.cat([pos, pos])[None].expand(b, -1)
    attention = MaskedAttention(block_diffusion_mask(t, model.config.block_size, ids.device))
    return model.hidden_states(torch.cat([noisy, ids], dim=1), positions, attention)[:, :t]


def compute_loss(
    model: DiffusionLM,
    batch: Batch,
    mask_id: int,
    eps: float,
    generator: torch.Generator | None = None,
) -> LossOutput:
    ids = batch.ids
    region = batch.loss_region
    b = ids.shape[0]
    block = model.config.block_size
    if block is not None and batch.mode != "causal":
        return _block_diffusion_loss(model, batch, mask_id, eps, generator)
    shift = model.config.shift_logits or block is not None  # SDAR's causal rows: next-token, as scored
    if batch.mode == "causal":
        inputs = ids
        targets_at = region
        weight = (1.0 / region.sum(dim=1).clamp_min(1).float())[:, None].expand_as(ids)
        attention = DenseAttention(causal=True)
    else:
        if batch.block_bounds is None:
            targets_at, p = mask_for_diffusion(region, eps, generator)
            weight = (1.0 / (p * region.sum(dim=1).clamp_min(1).float()))[:, None].expand_as(ids)
        else:
            # The 1/t weight is 1 / (the token's masking probability): the block's ratio inside it, 1 after
            # it (masked for sure; weighting those by 1/t would blow up at small t). Divided by the scored
            # tokens (the clean prefix is context), a row's expected loss is the mean cross-entropy of its
            # scored tokens, as a one-ratio row's is of its region's.
            targets_at, region, p = mask_for_block_decoding(region, batch.block_bounds, eps, generator)
            weight = 1.0 / (p * region.sum(dim=1, keepdim=True).clamp_min(1).float())
        inputs = torch.where(targets_at, torch.full_like(ids, mask_id), ids)
        if batch.mode == "chunk":
            attention = DenseAttention(mask=chunk_attention_mask(batch.segments, batch.sees_query))
        else:
            attention = DenseAttention()
    hidden = model.hidden_states(inputs, None, attention)
    if shift:
        # Dream (and causal rows): token i is predicted from the hidden state at i - 1 (position 0, BOS, is
        # never a target).
        sel = targets_at[:, 1:]
        h = hidden[:, :-1][sel]
        targets = ids[:, 1:][sel]
        scored_weight = weight[:, 1:][sel]
        in_answer = batch.answer_region[:, 1:][sel]
    else:
        h = hidden[targets_at]
        targets = ids[targets_at]
        scored_weight = weight[targets_at]
        in_answer = batch.answer_region[targets_at]
    return _scored(model, h, targets, scored_weight, in_answer, b)


def _block_diffusion_loss(
    model: DiffusionLM, batch: Batch, mask_id: int, eps: float, generator: torch.Generator | None
) -> LossOutput:
    ids, region = batch.ids, batch.loss_region
    b = ids.shape[0]
    if batch.block_bounds is not None:
        raise ValueError("block_mask_share is for Dream-layout models: SDAR rows are block-diffused already")
    targets_at, p = mask_for_blocks(region, model.config.block_size, eps, generator)
    hidden = block_diffusion_hidden(model, ids, targets_at, mask_id)
    weight = 1.0 / (p * region.sum(dim=1, keepdim=True).clamp_min(1).float())
    return _scored(
        model, hidden[targets_at], ids[targets_at], weight[targets_at], batch.answer_region[targets_at], b
    )


def _scored(
    model: DiffusionLM,
    h: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    in_answer: torch.Tensor,
    b: int,
) -> LossOutput:
    """The loss over the selected hidden states ``h`` and their targets (``weight`` per target)."""
    logits = model.lm_head(h).float()
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * weight).sum() / b
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == targets) & in_answer
    return LossOutput(
        loss=loss,
        ce=ce.detach().mean(),
        answer_correct=correct.sum(),
        answer_total=in_answer.sum(),
    )
