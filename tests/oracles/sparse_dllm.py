"""Oracle of Sparse-dLLM (``/work/shared/papers/sparse-dllm.txt``: Algorithms 1-4), per block of the response
(block rows ``[o, e)`` among the N local rows, b = e - o):

- **delayed cache update** (delay x): the block's first x steps are plain full steps (no cache read or
  written); step x is a full step that also takes the cache; later steps forward the block only (plus, on
  Dream, the row before it). With a refresh period N, steps in the block that are multiples of N (and at
  least x) take a new cache too;
- **bidirectional eviction**: at a caching step, per layer, the candidates are every row outside the block,
  prefix and suffix, in row order. Their saliency is the block queries' attention logits ``q.k / sqrt(d)``
  averaged over the block's queries and every query head (query head h reads KV head h // group), then
  max-pooled over neighbouring candidates (window ``kernel``, an edge pooling over its real neighbours).
  The first ``protected`` rows (pdllm's question) are always kept; of the other M' candidates the
  ``floor(M' r)`` of largest pooled saliency are kept (ties: the earlier candidate);
- a cached step's rows attend to the kept rows' cached K/V and to their own fresh K/V (a kept row that
  the step forwards is seen fresh), in row order.

Counters: forwards, refreshes (caching steps), local rows forwarded, and the largest cache held (the kept
rows' K/V).
"""

from __future__ import annotations

import math

import torch

from .plain import Static, Step, attend, source_rows, unmask


def pooled(scores: list[float], kernel: int) -> list[float]:
    r = kernel // 2
    return [max(scores[max(0, j - r) : j + r + 1]) for j in range(len(scores))]


def kept_rows(
    q: torch.Tensor, k: torch.Tensor, o: int, e: int, retention: float, kernel: int, protected: int
) -> list[int]:
    """The local rows a layer's cache keeps, from the caching step's q ``[1, Hq, N, D]`` and k."""
    n, heads, kv_heads, d = k.shape[2], q.shape[1], k.shape[1], q.shape[3]
    candidates = [r for r in range(n) if not o <= r < e]
    keys = k[0][:, candidates].float().repeat_interleave(heads // kv_heads, dim=0)  # [Hq, M, D]
    queries = q[0, :, o:e].float()  # [Hq, b, D]
    logits = torch.einsum("hbd,hmd->hbm", queries, keys) / math.sqrt(d)
    saliency = pooled(logits.mean(dim=(0, 1)).tolist(), kernel)
    free = list(range(protected, len(candidates)))
    quota = math.floor(len(free) * retention)
    best = sorted(free, key=lambda j: (-saliency[j], j))[:quota]
    return sorted([candidates[j] for j in range(protected)] + [candidates[j] for j in best])


class SparseDLLMOracle:
    def __init__(
        self,
        model,
        head: list[int],
        gen_length: int,
        retention: float,
        kernel: int,
        delay: int,
        refresh_every: int | None = None,
        protected: int = 0,
        static: Static = None,
        first_position: int = 0,
    ) -> None:
        self.model, self.static = model, static
        self.retention, self.kernel, self.delay, self.every = retention, kernel, delay, refresh_every
        self.protected = protected
        self.local = torch.tensor(head + [model.config.mask_token_id] * gen_length)
        self.rows = self.local.numel()
        self.positions = torch.arange(first_position, first_position + self.rows)
        self.response_start = len(head)
        self.lead = 1 if model.config.shift_logits else 0
        # Per layer: the caching step's K/V of every row, and the rows kept of them.
        self.cache: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
        self.kinds: list[str] = []
        self.counters = {"forwards": 0, "refreshes": 0, "rows_forwarded": 0, "cache_bytes": 0}

    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, None]:
        self.local[self.response_start :] = response
        i = step.step_in_block
        o, e = self.response_start + step.lo, self.response_start + step.hi
        if i < self.delay:
            kind = "plain"
        elif i == self.delay or (self.every is not None and i % self.every == 0):
            kind = "cache"
        else:
            kind = "cached"
        self.kinds.append(kind)
        a, z = (o - self.lead, e) if kind == "cached" else (0, self.rows)
        cache, static = self.cache, self.static

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kind == "cache":
                if layer == 0:
                    cache.clear()
                keep = kept_rows(q, k, o, e, self.retention, self.kernel, self.protected)
                cache.append((k, v, keep))
            elif kind == "cached":
                ck, cv, keep = cache[layer]
                before = [r for r in keep if r < a]
                after = [r for r in keep if r >= z]
                k = torch.cat([ck[:, :, before], k, ck[:, :, after]], dim=2)
                v = torch.cat([cv[:, :, before], v, cv[:, :, after]], dim=2)
            return attend(q, k, v, static, layer)

        hidden = self.model.hidden_states(self.local[None, a:z], self.positions[None, a:z], attention)[0]
        rows = [r - a for r in source_rows(self.model, self.response_start, step.masked)]
        c = self.counters
        c["forwards"] += 1
        c["refreshes"] += int(kind == "cache")
        c["rows_forwarded"] += z - a
        held = sum(2 * len(keep) * k.shape[1] * k.shape[3] * k.element_size() for k, _, keep in self.cache)
        c["cache_bytes"] = max(c["cache_bytes"], held)
        return self.model.lm_head(hidden[rows]), None

    def observe(self, step: Step, picked: list[int]) -> None:
        pass


@torch.inference_mode()
def sparse_dllm_decode(
    model,
    head: list[int],
    gen_length: int,
    block: int,
    steps: int,
    threshold: float | None,
    retention: float = 0.5,
    kernel: int = 3,
    delay: int = 1,
    refresh_every: int | None = None,
    protected: int = 0,
    static: Static = None,
    first_position: int = 0,
) -> tuple[list[int], dict[str, int], SparseDLLMOracle]:
    oracle = SparseDLLMOracle(
        model, head, gen_length, retention, kernel, delay, refresh_every, protected, static, first_position
    )
    tokens, _ = unmask(model.config.mask_token_id, gen_length, block, steps, threshold, oracle)
    return tokens, oracle.counters, oracle
