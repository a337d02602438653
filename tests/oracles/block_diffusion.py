"""Block diffusion (SDAR) from scratch: every denoising step recomputes the whole sequence so far.

SDAR attends causally across model blocks of ``block_size`` positions (aligned to position 0) and
bidirectionally inside one, so a step's logits need no cache at all: a forward over prompt + answer up to the
current generation block's end, under that mask, gives them (later, still-masked blocks are never seen). The
answer's generation blocks are aligned to absolute multiples of the generation block length (the first one
finishes the prompt's last partial block); each gets ``steps // (gen_length // block)`` steps, capped at its
length, an even split (earlier steps take the remainder, the last step takes what is left), greedy, or a
confidence threshold. Logits are unshifted (SDAR scores each position's own hidden state). No EOS stop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .plain import finish, greedy, head, project, rope, schedule


def _forward(model, seq: list[int]) -> torch.Tensor:
    """Last-layer outputs ``[n, hidden]`` of ``seq`` at positions ``0..n-1`` under the block-causal mask."""
    n, size = len(seq), model.config.block_size
    blocks = torch.arange(n) // size
    mask = blocks[None, :] <= blocks[:, None]  # query i sees key j iff block(j) <= block(i)
    cos, sin = rope(model, torch.arange(n))
    x = model.model.embed_tokens(torch.tensor(seq))
    for layer in model.model.layers:
        q, k, v = project(layer, x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        x = finish(layer, x, out)
    return x


def spans(prompt: int, gen_length: int, block: int) -> list[tuple[int, int]]:
    """The answer's generation blocks, absolute ``[lo, hi)``, cut at multiples of ``block``."""
    cuts = [prompt, *range((prompt // block + 1) * block, prompt + gen_length, block), prompt + gen_length]
    return list(zip(cuts, cuts[1:]))


@torch.inference_mode()
def block_diffusion(
    model, prompt: list[int], gen_length: int, block: int, steps: int, threshold: float | None
) -> tuple[list[int], int]:
    """The answer (every slot filled) and the number of denoising steps taken."""
    mask_id = model.config.mask_token_id
    seq = list(prompt) + [mask_id] * gen_length
    per_block = steps // (gen_length // block)
    taken = 0
    for lo, hi in spans(len(prompt), gen_length, block):
        counts = schedule(hi - lo, per_block)
        s = 0
        while masked := [j for j in range(lo, hi) if seq[j] == mask_id]:
            logits = head(model, _forward(model, seq[:hi])[masked])
            conf, pred = greedy(logits, mask_id)
            if threshold is None:
                quota = len(masked) if s >= len(counts) - 1 else min(counts[s], len(masked))
                chosen = torch.sort(conf, descending=True, stable=True).indices[:quota]
            else:
                chosen = (conf > threshold).nonzero().flatten()
                if chosen.numel() == 0:
                    chosen = conf.argmax().view(1)
            for c in chosen.tolist():
                seq[masked[c]] = int(pred[c])
            s += 1
            taken += 1
    return seq[len(prompt) :], taken
