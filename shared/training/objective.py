"""Losses: masked diffusion (MDLM/LLaDA, 1/t weighted) and next-token prediction under a causal mask."""

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
    if batch.mode == "causal":
        inputs = ids
        targets_at = region
        weight = 1.0 / region.sum(dim=1).clamp_min(1).float()
        attention = DenseAttention(causal=True)
    else:
        targets_at, p = mask_for_diffusion(region, eps, generator)
        inputs = torch.where(targets_at, torch.full_like(ids, mask_id), ids)
        weight = 1.0 / (p * region.sum(dim=1).clamp_min(1).float())
        if batch.mode == "chunk":
            attention = DenseAttention(mask=chunk_attention_mask(batch.segments, batch.sees_query))
        else:
            attention = DenseAttention()
    hidden = model.hidden_states(inputs, None, attention)
    if model.config.shift_logits:
        # Dream: token i is predicted from the hidden state at i - 1 (position 0, BOS, is never a target).
        sel = targets_at[:, 1:]
        h = hidden[:, :-1][sel]
        targets = ids[:, 1:][sel]
        row = torch.arange(b, device=ids.device)[:, None].expand(-1, ids.shape[1] - 1)[sel]
        in_answer = batch.answer_region[:, 1:][sel]
    else:
        h = hidden[targets_at]
        targets = ids[targets_at]
        row = torch.arange(b, device=ids.device)[:, None].expand_as(ids)[targets_at]
        in_answer = batch.answer_region[targets_at]
    logits = model.lm_head(h).float()
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * weight[row]).sum() / b
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == targets) & in_answer
    return LossOutput(
        loss=loss,
        ce=ce.detach().mean(),
        answer_correct=correct.sum(),
        answer_total=in_answer.sum(),
    )
