"""Oracle of DyLLM (``/work/shared/papers/dyllm.txt``, with the released code where the paper is silent).

- **Steps** (App. C.1): the decode's first ``full_steps`` forwards are FullSteps, a plain forward of every
  local row that keeps, per layer, K/V (after RoPE), the attention context C (before ``o_proj``) and the FFN
  output F. Later forwards are SparseSteps; forward t (0-based) queries every local row when ``t + 1`` is a
  multiple of ``interval`` (§3.5), otherwise only the response (and, on Dream, the row before it). Rows not
  queried keep their cached activations.
- **SparseStep, layer l** (App. C.3, §3.2-3.3): the incoming salient rows S are, at layer 0, the queried
  rows whose token changed since the previous forward, and at layer l > 0 the rows layer l - 1 selected.
  Every queried row gets a fresh query; the rows of S get fresh K/V (kept in the cache), every other row
  keeps its cached K/V. Rows of S attend exactly; with ``approximate`` on, every other queried row updates
  its context as ``C_t = C_{t-1} + A_t (V_t - V_{t-1})`` (eq. 3 with the routing held: the same attention
  weights applied to the value change only), else it attends exactly too. A row is selected when the
  cosine similarity of its new context to its cached one, ``<C_t, C_{t-1}> / (|C_t| |C_{t-1}|)``, is below
  tau (tau = 1: every row). Every queried row adds ``o_proj(C_t)``; the selected rows recompute their FFN
  (the others add their cached F); the selected rows are the next layer's S.

Counters: forwards, FullSteps, response-only steps, FFN rows (``rows_forwarded``) and K/V rows
(``kv_rows``) summed over layers, and ``rows_total`` = local rows x layers per forward.
"""

from __future__ import annotations

import torch

from .plain import Static, Step, attend, head, project, rope, source_rows, unmask


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of two ``[T, F]`` tensors, in float64 (zero rows: similarity 0)."""
    a, b = a.double(), b.double()
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(norms > 0, (a * b).sum(-1) / norms.clamp_min(1e-300), torch.zeros_like(norms))


def flat(out: torch.Tensor) -> torch.Tensor:
    """Attention output ``[1, Hq, T, D]`` as contexts ``[T, Hq * D]``."""
    return out[0].transpose(0, 1).reshape(out.shape[2], -1)


class DyLLMOracle:
    def __init__(
        self,
        model,
        head_tokens: list[int],
        gen_length: int,
        threshold: float,
        full_steps: int,
        interval: int,
        approximate: bool,
        static: Static = None,
        first_position: int = 0,
    ) -> None:
        self.model, self.static = model, static
        self.threshold, self.full_steps, self.interval, self.approximate = (
            threshold,
            full_steps,
            interval,
            approximate,
        )
        self.local = torch.tensor(head_tokens + [model.config.mask_token_id] * gen_length)
        self.rows = self.local.numel()
        self.cos, self.sin = rope(model, torch.arange(first_position, first_position + self.rows))
        self.response_start = len(head_tokens)
        self.lead = 1 if model.config.shift_logits else 0
        self.layers = list(model.model.layers)
        self.previous: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.contexts: list[torch.Tensor] = []
        self.ffn: list[torch.Tensor] = []
        # Per SparseStep and layer: (incoming salient rows, selected rows), as local rows.
        self.salient_log: list[list[tuple[list[int], list[int]]]] = []
        self.margin = float("inf")  # the closest any similarity came to tau
        self.counters = dict.fromkeys(
            ("forwards", "full_steps", "response_only_steps", "rows_forwarded", "kv_rows", "rows_total"), 0
        )

    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, None]:
        self.local[self.response_start :] = response
        c = self.counters
        t = c["forwards"]
        if t < self.full_steps:
            x = self._full()
            first = 0
            c["full_steps"] += 1
        else:
            response_only = (t + 1) % self.interval != 0
            first = self.response_start - self.lead if response_only else 0
            x = self._sparse(first)
            c["response_only_steps"] += int(response_only)
        self.previous = self.local.clone()
        c["forwards"] += 1
        c["rows_total"] += self.rows * len(self.layers)
        rows = [r - first for r in source_rows(self.model, self.response_start, step.masked)]
        return head(self.model, x[rows]), None

    def observe(self, step: Step, picked: list[int]) -> None:
        pass

    def _full(self) -> torch.Tensor:
        x = self.model.model.embed_tokens(self.local[None])[0]
        self.keys, self.values, self.contexts, self.ffn = [], [], [], []
        for li, layer in enumerate(self.layers):
            q, k, v = project(layer, x, self.cos, self.sin)
            context = flat(attend(q, k, v, self.static, li))
            x = x + layer.self_attn.o_proj(context[None])[0]
            f = layer.mlp(layer.post_attention_layernorm(x[None]))[0]
            x = x + f
            self.keys.append(k)
            self.values.append(v)
            self.contexts.append(context)
            self.ffn.append(f)
        self.counters["rows_forwarded"] += self.rows * len(self.layers)
        self.counters["kv_rows"] += self.rows * len(self.layers)
        return x

    def _sparse(self, first: int) -> torch.Tensor:
        assert self.previous is not None
        m = self.rows - first
        x = self.model.model.embed_tokens(self.local[None, first:])[0]
        cos, sin = self.cos[first:], self.sin[first:]
        if self.threshold >= 1:
            salient = list(range(m))
        else:
            salient = [i for i in range(m) if int(self.local[first + i]) != int(self.previous[first + i])]
        log = []
        for li, layer in enumerate(self.layers):
            q, k, v = project(layer, x, cos, sin)
            old_v = self.values[li]
            keys, values = self.keys[li].clone(), old_v.clone()
            for i in salient:
                keys[:, :, first + i] = k[:, :, i]
                values[:, :, first + i] = v[:, :, i]
            exact = flat(attend(q, keys, values, self.static, li))
            before = self.contexts[li][first:]
            if self.approximate:
                context = before + (exact - flat(attend(q, keys, old_v, self.static, li)))
                for i in salient:
                    context[i] = exact[i]
            else:
                context = exact
            if self.threshold >= 1:
                chosen = list(range(m))
            else:
                similarity = cosine(context, before).tolist()
                chosen = [i for i in range(m) if similarity[i] < self.threshold]
                self.margin = min([self.margin, *(abs(s - self.threshold) for s in similarity)])
            contexts = self.contexts[li].clone()
            contexts[first:] = context
            x = x + layer.self_attn.o_proj(context[None])[0]
            ffn = self.ffn[li].clone()
            if chosen:
                out = layer.mlp(layer.post_attention_layernorm(x[None, chosen]))[0]
                for j, i in enumerate(chosen):
                    ffn[first + i] = out[j]
            x = x + ffn[first:]
            self.keys[li], self.values[li], self.contexts[li], self.ffn[li] = keys, values, contexts, ffn
            self.counters["kv_rows"] += len(salient)
            self.counters["rows_forwarded"] += len(chosen)
            log.append(([first + i for i in salient], [first + i for i in chosen]))
            salient = chosen
        self.salient_log.append(log)
        return x


@torch.inference_mode()
def dyllm_decode(
    model,
    head_tokens: list[int],
    gen_length: int,
    block: int,
    steps: int,
    threshold_conf: float | None,
    tau: float,
    full_steps: int = 4,
    interval: int = 4,
    approximate: bool = True,
    static: Static = None,
    first_position: int = 0,
) -> tuple[list[int], dict[str, int], DyLLMOracle]:
    """``threshold_conf``: the sampler's confidence threshold (None: fixed schedule); ``tau``: DyLLM's."""
    oracle = DyLLMOracle(
        model, head_tokens, gen_length, tau, full_steps, interval, approximate, static, first_position
    )
    tokens, _ = unmask(model.config.mask_token_id, gen_length, block, steps, threshold_conf, oracle)
    return tokens, oracle.counters, oracle
