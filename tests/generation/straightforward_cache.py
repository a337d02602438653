"""A second, from-scratch Fast-dLLM cache loop for the decode-policy tests (shares no code with
``decode_service/policies`` or the sampler): per block, one full forward computes every row's K/V; the
block's later steps forward only the block (dual) or the block and everything after it (prefix), the other
rows' K/V taken from that forward by plain slicing and concatenation. Greedy; fixed schedule or threshold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdllm.shared.model.transformer import DiffusionLM


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, static: torch.Tensor | None, layer: int):
    if static is not None:  # pdllm: the static chunk KV first, then the local rows
        k = torch.cat([static[layer, 0][None], k], dim=2)
        v = torch.cat([static[layer, 1][None], v], dim=2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def _unmask_counts(block: int, steps_per_block: int) -> list[int]:
    n = min(steps_per_block, block)
    return [block // n + (1 if i < block % n else 0) for i in range(n)]


@torch.inference_mode()
def straightforward_cache_loop(
    model: DiffusionLM,
    head: list[int],
    gen_length: int,
    block: int,
    steps: int,
    dual: bool,
    threshold: float | None = None,
    static: torch.Tensor | None = None,
    first_position: int = 0,
) -> list[int]:
    """Response tokens after ``head`` (vanilla: the prompt; pdllm: the query suffix, with ``static`` =
    ``[layers, 2, Hkv, S, D]`` chunk KV and ``first_position`` = the query's first position id)."""
    mask = model.config.mask_token_id
    x = torch.tensor(head + [mask] * gen_length)
    n, p = x.numel(), len(head)
    pos = torch.arange(first_position, first_position + n)
    lead = 1 if model.config.shift_logits else 0
    for b in range(gen_length // block):
        lo, hi = p + b * block, p + (b + 1) * block
        cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        counts = _unmask_counts(block, steps // (gen_length // block))
        step = 0
        while bool((x[lo:hi] == mask).any()):
            if step == 0:  # the block's first step: everything, keeping each layer's K/V

                def full(layer, q, k, v, cached=cached):
                    cached[layer] = (k, v)
                    return _attend(q, k, v, static, layer)

                logits = model(x[None], pos[None], full)[0][lo:hi]
            else:
                a, e = lo - lead, hi if dual else n

                def part(layer, q, k, v, a=a, e=e, cached=cached):
                    ck, cv = cached[layer]
                    k = torch.cat([ck[:, :, :a], k, ck[:, :, e:]], dim=2)
                    v = torch.cat([cv[:, :, :a], v, cv[:, :, e:]], dim=2)
                    return _attend(q, k, v, static, layer)

                logits = model(x[None, a:e], pos[None, a:e], part)[0][lo - a : hi - a]
            logits = logits.float().clone()
            logits[:, mask] = float("-inf")
            conf, pred = torch.softmax(logits, dim=-1).max(dim=-1)
            masked = (x[lo:hi] == mask).nonzero().flatten()
            conf, pred = conf[masked], pred[masked]
            if threshold is not None:
                chosen = (conf > threshold).nonzero().flatten()
                chosen = chosen if chosen.numel() else conf.argmax().view(1)
            else:
                k = masked.numel() if step == len(counts) - 1 else min(counts[step], masked.numel())
                chosen = torch.sort(conf, descending=True, stable=True).indices[:k]
            x[lo + masked[chosen]] = pred[chosen]
            step += 1
    return x[p:].tolist()
