"""Oracle of Fast-dLLM's prefix and dual cache with the periodic refresh (``cache_refresh_steps``).

Semantics (Fast-dLLM, as Polestar-Cache §A.2 / eq. 7 and Sparse-dLLM's related work state it): a block's
first step forwards every local row and keeps each layer's K/V (the refresh); with a refresh period N the
cache is also refreshed once N steps have run since the last refresh in the block. Between refreshes a step
forwards only the block (dual cache) or the block and every row after it (prefix cache), plus on Dream the
row just before the block (its hidden state predicts the block's first token); those rows attend to the
cached K/V of every other row and to their own fresh K/V. The counters are counted here from what the loop
does: forwards, refreshes, local rows forwarded, and the largest K/V cache held.
"""

from __future__ import annotations

import torch

from .plain import Static, Step, attend, source_rows, unmask


class FastDLLMOracle:
    def __init__(
        self,
        model,
        head: list[int],
        gen_length: int,
        dual: bool,
        refresh_every: int | None,
        static: Static = None,
        first_position: int = 0,
    ) -> None:
        self.model, self.dual, self.every, self.static = model, dual, refresh_every, static
        mask = model.config.mask_token_id
        self.local = torch.tensor(head + [mask] * gen_length)
        self.rows = self.local.numel()
        self.positions = torch.arange(first_position, first_position + self.rows)
        self.response_start = len(head)
        self.lead = 1 if model.config.shift_logits else 0
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.since_refresh = 0
        self.refreshed_at: list[tuple[int, int]] = []  # (block, step in block) of every refresh
        self.counters = {"forwards": 0, "refreshes": 0, "rows_forwarded": 0, "cache_bytes": 0}

    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, None]:
        self.local[self.response_start :] = response
        refresh = step.step_in_block == 0 or (self.every is not None and self.since_refresh == self.every)
        if refresh:
            a, e = 0, self.rows
            self.since_refresh = 0
            self.refreshed_at.append((step.block, step.step_in_block))
        else:
            a = self.response_start + step.lo - self.lead
            e = self.response_start + step.hi if self.dual else self.rows
        cache, static = self.cache, self.static

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if refresh:
                if layer == 0:
                    cache.clear()
                cache.append((k, v))
            else:
                ck, cv = cache[layer]
                k = torch.cat([ck[:, :, :a], k, ck[:, :, e:]], dim=2)
                v = torch.cat([cv[:, :, :a], v, cv[:, :, e:]], dim=2)
            return attend(q, k, v, static, layer)

        hidden = self.model.hidden_states(self.local[None, a:e], self.positions[None, a:e], attention)[0]
        rows = [r - a for r in source_rows(self.model, self.response_start, step.masked)]
        self.since_refresh += 1
        c = self.counters
        c["forwards"] += 1
        c["refreshes"] += int(refresh)
        c["rows_forwarded"] += e - a
        held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.cache)
        c["cache_bytes"] = max(c["cache_bytes"], held)
        return self.model.lm_head(hidden[rows]), None

    def observe(self, step: Step, picked: list[int]) -> None:
        pass


@torch.inference_mode()
def fast_dllm_decode(
    model,
    head: list[int],
    gen_length: int,
    block: int,
    steps: int,
    threshold: float | None,
    dual: bool,
    refresh_every: int | None = None,
    static: Static = None,
    first_position: int = 0,
) -> tuple[list[int], dict[str, int], FastDLLMOracle]:
    """The response, the counters and the oracle (its ``refreshed_at``) of one greedy decode after
    ``head`` (vanilla: the prompt; pdllm: the query suffix over ``static`` from ``first_position``)."""
    oracle = FastDLLMOracle(model, head, gen_length, dual, refresh_every, static, first_position)
    tokens, _ = unmask(model.config.mask_token_id, gen_length, block, steps, threshold, oracle)
    return tokens, oracle.counters, oracle
