"""What the oracles share among themselves, written from the model's public pieces and plain torch.

- RoPE tables and rotation (``rope``, ``rotate``): the rotate-half convention of Qwen2 / LLaMA;
- one decoder layer in pieces (``project``, ``attend``, ``finish``): the layer's own norm and projection
  modules, attention as one SDPA call over an optional static prefix (pdllm's chunk KV) then the given
  local K/V, the residual and the MLP;
- the unmasking rule of LLaDA / Dream / Fast-dLLM (``unmask``): semi-autoregressive blocks, per block
  ``steps / blocks`` steps with an even split of the block's tokens (earlier steps take the remainder, the
  block's last step takes what is left), greedy predictions that never predict [MASK], the top-k most
  confident (ties: the lower position) or every prediction above the confidence threshold (at least the
  most confident one); a policy may restrict a step to some eligible positions (FOCUS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

# Per layer, the static prefix's (keys, values) ``[1, Hkv, S, D]`` (pdllm's chunk KV); None: vanilla.
Static = list[tuple[torch.Tensor, torch.Tensor]] | None


def rope(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, D]`` of positions ``[n]`` (plain RoPE, no scaling)."""
    cfg = model.config
    assert not cfg.rope_scaling, "the oracles run unscaled RoPE only"
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    angles = positions.float()[:, None] * inv_freq.float()
    emb = torch.cat([angles, angles], dim=-1)
    dtype = model.lm_head.weight.dtype
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[1, H, n, D]`` with tables ``[n, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def project(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q ``[1, Hq, n, D]``, k, v ``[1, Hkv, n, D]`` (RoPE'd q and k) of layer inputs ``x`` ``[n, hidden]``."""
    attn = layer.self_attn
    n = x.shape[0]
    h = layer.input_layernorm(x[None])
    q = attn.q_proj(h).view(1, n, attn.num_heads, attn.head_dim)
    k = attn.k_proj(h).view(1, n, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(h).view(1, n, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, static: Static, layer: int) -> torch.Tensor:
    """Every query sees the static prefix (if any) and then the given keys; output ``[1, Hq, n, D]``."""
    if static is not None:
        k = torch.cat([static[layer][0], k], dim=2)
        v = torch.cat([static[layer][1], v], dim=2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def finish(layer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The rest of the layer for inputs ``x`` ``[n, hidden]`` given their attention output ``out``."""
    n = x.shape[0]
    h = x[None] + layer.self_attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
    return (h + layer.mlp(layer.post_attention_layernorm(h)))[0]


def head(model, x: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, V]`` from last-layer outputs ``x`` ``[n, hidden]`` (final norm, LM head)."""
    return model.lm_head(model.model.norm(x[None]))[0]


def source_rows(model, response_start: int, positions: list[int]) -> list[int]:
    """Local rows whose hidden states predict the response ``positions``: Dream predicts token i from the
    state at i - 1, LLaDA from its own."""
    lead = 1 if model.config.shift_logits else 0
    return [response_start + p - lead for p in positions]


def greedy(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, token) per row: the most probable non-[MASK] token and its softmax probability."""
    z = logits.float().clone()
    z[:, mask_id] = float("-inf")
    return torch.softmax(z, dim=-1).max(dim=-1)


def schedule(block: int, steps: int) -> list[int]:
    """Tokens each step of a block unmasks: ``min(steps, block)`` steps, as even as possible."""
    n = min(steps, block)
    return [block // n + (1 if i < block % n else 0) for i in range(n)]


@dataclass(frozen=True)
class Step:
    """Where a denoising step stands: the block's response span ``[lo, hi)``, its masked positions
    (ascending), the step within the block, the decode's step, and the fixed schedule's count (None under a
    confidence threshold)."""

    block: int
    lo: int
    hi: int
    masked: list[int]
    step_in_block: int
    step: int
    quota: int | None


class Stepper(Protocol):
    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[len(step.masked), V]`` and which of those positions may be unmasked (None: all)."""
        ...

    def observe(self, step: Step, picked: list[int]) -> None:
        """The response positions the step unmasked."""
        ...


def unmask(
    mask_id: int, gen_length: int, block: int, steps: int, threshold: float | None, stepper: Stepper
) -> tuple[list[int], int]:
    """The response (every slot filled) and the number of steps taken (greedy, no EOS stop)."""
    tokens = [mask_id] * gen_length
    blocks = gen_length // block
    per_block = steps // blocks
    taken = 0
    for b in range(blocks):
        lo, hi = b * block, (b + 1) * block
        counts = schedule(block, per_block)
        s = 0
        while True:
            masked = [j for j in range(lo, hi) if tokens[j] == mask_id]
            if not masked:
                break
            quota = None
            if threshold is None:
                quota = len(masked) if s >= len(counts) - 1 else min(counts[s], len(masked))
            step = Step(b, lo, hi, masked, s, taken, quota)
            logits, eligible = stepper.logits(torch.tensor(tokens), step)
            conf, pred = greedy(logits, mask_id)
            allowed = len(masked)
            if eligible is not None:
                conf = torch.where(eligible, conf, torch.full_like(conf, float("-inf")))
                allowed = int(eligible.sum())
            if threshold is None:
                assert quota is not None
                chosen = torch.sort(conf, descending=True, stable=True).indices[: min(quota, allowed)]
            else:
                chosen = (conf > threshold).nonzero().flatten()
                if chosen.numel() == 0:
                    chosen = conf.argmax().view(1)
            picked = sorted(masked[int(c)] for c in chosen)
            for c in chosen.tolist():
                tokens[masked[c]] = int(pred[c])
            stepper.observe(step, picked)
            s += 1
            taken += 1
    return tokens, taken
