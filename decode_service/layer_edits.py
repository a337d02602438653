"""A decode policy's edits of its rows inside a round's layers (DyLLM: ``dyllm_rounds.py``).

A part of a round may carry a :class:`PartEdit`. The round's forward gathers the parts of one kind into one
:class:`LayerEdits` (:func:`group_edits`), which every layer's attention (``round_attention.
PagedBatchAttention``) calls: :meth:`~LayerEdits.before` the attention (it may replace the parts' fresh K/V,
which the kernel then reads as their own K/V, and store K/V in the pool), :meth:`~LayerEdits.after` it (it
may replace the parts' attention outputs) and, through the decoder layer, :meth:`~LayerEdits.ffn` (it may
replace the parts' FFN outputs). Every other row of the round is computed as in any round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pdllm.decode_service.round_attention import PagedBatchAttention
    from pdllm.decode_service.round_packing import PackedRound


class LayerEdits(Protocol):
    """The edited parts of one kind in a round. ``wants_lse``: :meth:`after` reads the attention's row
    log-sum-exp (``attention.lse``), so the attention computes it."""

    wants_lse: bool

    def before(self, layer: int, k: torch.Tensor, v: torch.Tensor, attention: PagedBatchAttention) -> None:
        """Before the attention: ``k``, ``v`` ``[T, Hkv, D]`` the round's fresh K/V (editable in place)."""
        ...

    def after(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, attention: PagedBatchAttention
    ) -> torch.Tensor:
        """After it: ``q``, ``out`` ``[T, Hq, D]`` the queries and attention outputs; returns the outputs."""
        ...

    def ffn(self, layer: int, ffn: torch.Tensor) -> torch.Tensor:
        """The layer's FFN output ``[1, T, H]`` (before the residual add); returns it, edited."""
        ...


class PartEdit(Protocol):
    """One part's edit; :meth:`group` gathers a round's edits of one kind, as (attention entry, first
    packed row, edit), packed order."""

    @classmethod
    def group(cls, members: list[tuple[int, int, PartEdit]]) -> LayerEdits: ...


def group_edits(packed: PackedRound) -> list[LayerEdits]:
    """One :class:`LayerEdits` per kind of edit among ``packed``'s parts."""
    kinds: dict[type, list[tuple[int, int, PartEdit]]] = {}
    for member in packed.edits:
        kinds.setdefault(type(member[2]), []).append(member)
    return [kind.group(members) for kind, members in kinds.items()]
