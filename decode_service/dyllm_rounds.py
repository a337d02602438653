"""DyLLM (Dream / LLaDA) in the batched rounds: each request's step rides in the round's one forward.

A :class:`DyLLMBatchSession` is a :class:`~.rounds.BatchSession` whose steps follow DyLLM (``policies/
dyllm_base.py`` says what the method does; its reference loop, ``tests/reference/dyllm.py``, is the
specification). Its pool pages hold its static KV, then one cache slot per local row (query or prompt, then
the response): every layer's K/V of that row as of the last forward that touched it. Its attention contexts
and FFN outputs are two tensors of its own (``[layers, rows, .]``). Per step
(:func:`~.policies.dyllm_base.step_kind`):

- a **FullStep** forwards every local row over the static KV, stores each row's K/V in its cache slot and
  keeps every context and FFN output;
- a **SparseStep** forwards the queried rows ``[first, N)`` (the response only, plus the row before it on
  Dream; every row on each ``full_sequence_interval``-th forward); its queries read the static KV and the
  cache slots of the rows before ``first`` besides the rows' own K/V. Per layer (:class:`DyLLMRound`, one
  for every DyLLM session of a round): the incoming salient rows keep their fresh K/V, the others take
  their cached K/V (written back into the slots); after the attention, salient rows keep the exact context,
  the others ``C_{t-1} + A_t ΔV`` with ``ΔV`` the value change, zero outside the salient rows, so only the
  salient columns of ``A_t`` are summed (``kernels/salient_attention.py``; exactly the reference's
  ``A_t V_t - A_t V_{t-1}``, without its second attention: ``A_t``'s normalizer is the row's log-sum-exp
  that the round's attention already formed over the same keys (``PagedBatchAttention.lse``), so the
  update reads only the salient rows' keys and value changes); the rows whose
  context turned past τ are the layer's salient set, and they keep their fresh FFN output, the others
  their cached one.

The GEMMs run over every queried row (a round is bound by weight reads, not by rows); what DyLLM skips is
its choice of which rows' activations change. A session with ``DyLLMConfig.replay_ffn_frac`` (benchmarks)
takes the ``ceil(f x queried rows)`` rows of lowest cosine instead of τ's at every SparseStep layer
(:func:`lowest_per_member`). Such rounds run eagerly (the choice is made inside the
forward); the session samples on the host (the next step's first salient rows are the tokens that changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdllm.decode_service.layer_edits import PartEdit
from pdllm.decode_service.policies.dyllm_base import DyLLMConfig, DyLLMStats, context_cosine, step_kind
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import RoundRows
from pdllm.decode_service.rounds import CachingSession
from pdllm.kernels.salient_attention import salient_attention, salient_attention_reference, salient_columns
from pdllm.shared.decode_policy import replay_ceil
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import DenoiseState, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


@dataclass
class DyLLMBatchSession(CachingSession):
    """A Dream/LLaDA request under DyLLM in the rounds (host sampler). Made by :meth:`begin`."""

    dyllm: DyLLMConfig = field(default_factory=DyLLMConfig)
    lead: int = 0  # 1: a row's logits come from the row before it (Dream)
    threshold: float = 1.0
    contexts: torch.Tensor | None = None  # [layers, N, Hq * D]
    ffn: torch.Tensor | None = None  # [layers, N, H]
    counts: torch.Tensor | None = None  # [2] on the device: K/V rows, FFN rows (summed over layers)
    previous: list[int] | None = None  # the local tokens of the last forward
    stats: DyLLMStats = field(default_factory=DyLLMStats)

    @classmethod
    def begin(
        cls, model: DiffusionLM, built: StaticDecode, pages: list[int], page_size: int
    ) -> DyLLMBatchSession:
        c = model.config
        if c.block_size is not None:
            raise ValueError("DyLLM runs on bidirectional models (Dream, LLaDA), not block diffusion (SDAR)")
        dyllm, gen = built.cache_policy, built.gen
        assert isinstance(dyllm, DyLLMConfig)
        rows = len(built.query) + gen.gen_length
        need = -(-(built.kv_tokens + rows) // page_size)
        if len(pages) < need:
            raise ValueError(
                f"a DyLLM session needs {need} pages (static KV + its rows' K/V), got {len(pages)}"
            )
        weight = model.model.embed_tokens.weight
        hq = c.num_heads * c.head_dim
        state = DenoiseState(gen, c.mask_token_id, c.eos_token_id, "cpu")
        return cls(
            list(built.query), built.query_start, built.kv_tokens, list(pages), state, dyllm=dyllm,
            page_size=page_size, lead=1 if c.shift_logits else 0, threshold=dyllm.threshold_for(c.family),
            contexts=weight.new_zeros(c.num_layers, rows, hq), ffn=weight.new_zeros(c.num_layers, rows, c.hidden_size),
            counts=torch.zeros(2, dtype=torch.long, device=weight.device),
        )  # fmt: skip

    def round_parts(self) -> list[RoundRows]:
        """The next step's rows: all of them (a FullStep), or ``[first, N)`` over the cached rows before."""
        assert isinstance(self.state, DenoiseState)
        tokens = self.query + self.state.tokens.tolist()
        n, q = self.local_rows, len(self.query)
        kind = step_kind(self.stats.forwards, self.dyllm)
        full = kind == "full"
        first = 0 if kind != "response" else q - self.lead
        if full or self.previous is None or self.threshold >= 1.0:
            salient = [True] * (n - first)
        else:
            salient = [a != b for a, b in zip(tokens[first:], self.previous[first:], strict=True)]
        self.previous = tokens
        st = self.stats
        st.forwards += 1
        st.full_steps += int(full)
        st.response_only_steps += int(kind == "response")
        layers = self.contexts.shape[0] if self.contexts is not None else 0
        st.rows_total += n * layers
        edit = DyLLMEdit(self, first, tuple(salient), full)
        return [RoundRows(first, n, self.kv_tokens + first, edit=edit)]

    def result(self) -> GenerationResult:
        result = super().result()
        assert self.counts is not None
        self.stats.kv_rows, self.stats.rows_forwarded = self.counts.tolist()
        result.cache = {"policy": "dyllm", **self.stats.as_dict()}
        return result


@dataclass(frozen=True)
class DyLLMEdit:
    """One DyLLM session's step in a round: queried rows ``[first, N)``, the first layer's incoming
    ``salient`` rows among them, ``full``: a FullStep."""

    session: DyLLMBatchSession
    first: int
    salient: tuple[bool, ...]
    full: bool

    @classmethod
    def group(cls, members: list[tuple[int, int, PartEdit]]) -> DyLLMRound:
        return DyLLMRound(members)  # type: ignore[arg-type]


class DyLLMRound:
    """The DyLLM sessions of one round (:class:`~.layer_edits.LayerEdits`), their rows edited as one."""

    def __init__(self, members: list[tuple[int, int, DyLLMEdit]]) -> None:
        self.members = members
        edits = [e for _, _, e in members]
        s0 = edits[0].session
        assert s0.contexts is not None
        device = s0.contexts.device
        sizes = [e.session.local_rows - e.first for e in edits]
        packed = [first + j for (_, first, _), n in zip(members, sizes, strict=True) for j in range(n)]
        slots = [e.session.slot(r) for e in edits for r in range(e.first, e.session.local_rows)]
        member = [i for i, n in enumerate(sizes) for _ in range(n)]
        exact = [e.full or not e.session.dyllm.approximate_attention for e in edits]
        # a replayed share decides a SparseStep's layers instead of τ (``DyLLMConfig.replay_ffn_frac``)
        forced = [None if e.full else e.session.dyllm.replay_ffn_frac for e in edits]
        every = [
            e.full or (e.session.threshold >= 1.0 and f is None) for e, f in zip(edits, forced, strict=True)
        ]
        per_row = [(x, a) for x, a, m in zip(exact, every, sizes, strict=True) for _ in range(m)]
        salient = [int(f) for e in edits for f in e.salient]
        longs = to_device(
            [*packed, *(p for p, _ in slots), *(o for _, o in slots), *member, *(0, *sizes), *salient,
             *(int(x) for x, _ in per_row), *(int(a) for _, a in per_row)],
            torch.long,
            device,
        )  # fmt: skip
        n, b = len(packed), len(edits)
        self.rows, self.pages, self.offsets = longs[:n], longs[n : 2 * n], longs[2 * n : 3 * n]
        self.member = longs[3 * n : 4 * n]
        self.q_offsets = longs[4 * n : 4 * n + b + 1].cumsum(0).to(torch.int32)
        flags = longs[4 * n + b + 1 :].view(3, n).bool()
        self.salient = flags[0]  # this layer's incoming salient rows
        self.exact, self.every = flags[1], flags[2]
        self.threshold = to_device(
            [e.session.threshold for e, m in zip(edits, sizes, strict=True) for _ in range(m)],
            torch.float32,
            device,
        )
        self.approximate = not all(exact)
        self.forced: tuple[torch.Tensor, torch.Tensor] | None = None  # per row: forced, its member's count
        if any(f is not None for f in forced):
            counts = [0 if f is None else replay_ceil(f * m) for f, m in zip(forced, sizes, strict=True)]
            per = [
                (int(f is not None), c)
                for f, c, m in zip(forced, counts, sizes, strict=True)
                for _ in range(m)
            ]
            flags = to_device([x for pair in per for x in pair], torch.long, device).view(-1, 2).T
            self.forced = (flags[0].bool(), flags[1])
        self.wants_lse = self.approximate  # A_t's normalizer, from the attention (LayerEdits)
        self.entries = to_device([e for e, _, _ in members], torch.long, device)
        self.entry_meta: tuple[PagedBatchAttention, torch.Tensor, torch.Tensor] | None = None
        self.sizes, self.max_q = sizes, max(sizes)
        self.edits = edits
        self.counts = torch.zeros(2, b, dtype=torch.long, device=device)
        self.layers = s0.contexts.shape[0]
        self.dv: torch.Tensor | None = None  # this layer's value change of the rows, float32
        self.new_k: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None

    def _entries_of(self, attention: PagedBatchAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The DyLLM entries' page tables and KV lengths in ``attention`` (selected once per attention: a
        round has one, and one more past a split)."""
        if self.entry_meta is None or self.entry_meta[0] is not attention:
            entries = self.entries
            table = attention.page_table.index_select(0, entries)
            self.entry_meta = (attention, table, attention.kv_lens.index_select(0, entries))
        return self.entry_meta[1], self.entry_meta[2]

    def _cached(self, which: str, layer: int) -> list[torch.Tensor]:
        """Each session's cached contexts or FFN outputs of its queried rows at ``layer`` (views)."""
        return [getattr(e.session, which)[layer, e.first :] for e in self.edits]

    def before(self, layer: int, k: torch.Tensor, v: torch.Tensor, attention: PagedBatchAttention) -> None:
        """The salient rows keep their fresh K/V, the others take their cached K/V; both are stored."""
        kv = attention.kv[layer]
        old_k, old_v = kv[0][self.pages, :, self.offsets], kv[1][self.pages, :, self.offsets]
        keep = self.salient[:, None, None]
        new_k = torch.where(keep, k.index_select(0, self.rows), old_k)
        new_v = torch.where(keep, v.index_select(0, self.rows), old_v)
        k.index_copy_(0, self.rows, new_k)
        v.index_copy_(0, self.rows, new_v)
        kv[0][self.pages, :, self.offsets] = new_k
        kv[1][self.pages, :, self.offsets] = new_v
        self.new_k = new_k
        if self.approximate:  # in float32: a low-precision difference would round the update
            self.dv = new_v.float() - old_v.float()
        self.counts[0].index_add_(0, self.member, self.salient.long())

    def after(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, attention: PagedBatchAttention
    ) -> torch.Tensor:
        """Contexts: exact, or ``C_{t-1} + A_t ΔV`` over the salient columns; this layer's salient rows
        chosen."""
        n = self.rows.numel()
        exact = out.index_select(0, self.rows).reshape(n, -1)
        before = torch.cat(self._cached("contexts", layer))
        context = exact
        if self.approximate:
            assert self.dv is not None and self.new_k is not None
            assert attention.lse is not None  # asked for by wants_lse
            table, kv_lens = self._entries_of(attention)
            columns, counts = salient_columns(self.salient, self.member, len(self.edits))
            update = salient_attention if attention.kernel == "triton" else salient_attention_reference
            delta = update(
                q.index_select(0, self.rows),
                attention.kv[layer, 0],
                table,
                kv_lens,
                self.q_offsets,
                self.new_k,
                self.dv,
                columns,
                counts,
                # The attention's normalizer over these rows' keys (static KV, then the entry's rows as
                # before() left them): the same set A_t spans, so no K-only pass over every key.
                lse=attention.lse.index_select(0, self.rows),
                max_q_len=self.max_q,
            ).reshape(n, -1)
            approx = (before.float() + delta).to(before.dtype)
            context = torch.where((self.salient | self.exact)[:, None], exact, approx)
        similarity = context_cosine(context, before)
        chosen = (similarity < self.threshold) | self.every
        if self.forced is not None:
            forced, count = self.forced
            top = lowest_per_member(similarity, self.member, self.q_offsets, count)
            chosen = torch.where(forced, top, chosen)
        torch._foreach_copy_(self._cached("contexts", layer), list(context.split(self.sizes)))
        self.chosen = chosen
        out.index_copy_(0, self.rows, context.view(n, *out.shape[1:]))
        return out

    def ffn(self, layer: int, ffn: torch.Tensor) -> torch.Tensor:
        """The chosen rows keep their fresh FFN output, the others their cached one; the chosen rows are
        the next layer's incoming salient rows."""
        assert self.chosen is not None
        flat = ffn[0]
        fresh = flat.index_select(0, self.rows)
        kept = torch.where(self.chosen[:, None], fresh, torch.cat(self._cached("ffn", layer)))
        torch._foreach_copy_(self._cached("ffn", layer), list(kept.split(self.sizes)))
        flat.index_copy_(0, self.rows, kept)
        self.counts[1].index_add_(0, self.member, self.chosen.long())
        self.salient = self.chosen
        if layer == self.layers - 1:
            for i, e in enumerate(self.edits):
                assert e.session.counts is not None
                e.session.counts.add_(self.counts[:, i])
        return ffn


def lowest_per_member(
    score: torch.Tensor, member: torch.Tensor, offsets: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """``[n]`` bool: per member (its rows contiguous from ``offsets[member]``, in row order), its ``count``
    rows of lowest ``score`` (ties: the lower row); ``count`` ``[n]``: each row's member's count."""
    order = torch.sort(score, stable=True).indices  # ascending; ties keep the lower row first
    order = order[torch.sort(member[order], stable=True).indices]  # grouped by member, order kept
    place = torch.arange(order.numel(), device=order.device) - offsets.long()[member[order]]
    rank = torch.empty_like(order).scatter_(0, order, place)
    return rank < count
