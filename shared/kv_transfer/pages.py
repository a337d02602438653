"""A decode-kv payload in page tiles: the layout it travels in, so that it can land in a decode pool's pages.

The decode worker keeps every session's static KV in a paged pool ``[layers, 2, pages, Hkv, page, D]`` (the
layout the split-S kernel reads, ``kernels/paged_kv.py``); a built decode KV is ``[layers, 2, Hkv, T, D]``.
In the pool a session's KV is ``2 * layers`` disjoint slabs (one per layer and K/V), each page-major
``[n, Hkv, page, D]``, while the built KV is head-major: no single tensor a transport receives into (one
NCCL/Gloo recv fills one contiguous buffer, in the sender's element order) can be the pool pages. So the
sender reorders a decode-kv payload once, on its side, into ``WIRE_PAGE``-token tiles
``[layers, 2, n, Hkv, WIRE_PAGE, D]`` (the tail tile zero-padded, as the pool pads it) and sends it as
``2 * layers`` slab messages; each slab is then byte for byte what the pool holds for that layer and K/V:

- a reservation of consecutive pages makes each slab one contiguous piece of the pool: NCCL and Gloo (on
  CPU) receive straight into it, CUDA IPC copies the sender's tiles into it;
- scattered pages: CUDA IPC copies with one ``index_copy_`` from the sender's memory (still no staging),
  NCCL/Gloo receive each slab into one slab-sized buffer and scatter it (``1 / (2 * layers)`` of the
  payload staged, not all of it);
- Gloo with a CUDA pool bounces each slab through host memory: Gloo moves CPU tensors only.

``KvHandoff.shape`` stays the logical ``[layers, 2, Hkv, T, D]``; the tiling is implied by the decode-kv
payload. Chunk-kv payloads (chunk-only) are the build's input, not the pool's content (K is re-rotated,
top-B compacts them), so they travel as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.kv_transfer.payload import DECODE_KV, WIRE_PAGE, dtype_name


def num_tiles(tokens: int) -> int:
    return -(-tokens // WIRE_PAGE)


def tiled_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``[layers, 2, Hkv, T, D]`` -> ``[layers, 2, ceil(T / WIRE_PAGE), Hkv, WIRE_PAGE, D]``."""
    layers, two, heads, tokens, dim = shape
    return (layers, two, num_tiles(tokens), heads, WIRE_PAGE, dim)


def wire_shape(handoff: wpb.KvHandoff) -> tuple[int, ...]:
    """The shape a payload travels in (and a sender holds it in)."""
    shape = tuple(handoff.shape)
    return tiled_shape(shape) if handoff.payload == DECODE_KV else shape


def to_tiles(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous tiled copy of ``kv`` ``[layers, 2, Hkv, T, D]`` (unused tail slots zero)."""
    t = kv.shape[3]
    tiles = kv.new_empty(tiled_shape(kv.shape))
    full = t // WIRE_PAGE
    tokens_view = tiles.transpose(2, 3)  # [layers, 2, Hkv, n, WIRE_PAGE, D], a view of the tiles
    tokens_view[:, :, :, :full].copy_(kv[:, :, :, : full * WIRE_PAGE].unflatten(3, (full, WIRE_PAGE)))
    if t % WIRE_PAGE:  # deterministic bytes past the last token (the pool's own write zero-pads too)
        tiles[:, :, full].zero_()
        tokens_view[:, :, :, full, : t % WIRE_PAGE].copy_(kv[:, :, :, full * WIRE_PAGE :])
    return tiles


def untile(tiles: torch.Tensor, tokens: int) -> torch.Tensor:
    """The ``[layers, 2, Hkv, tokens, D]`` tensor that :func:`to_tiles` tiled (a new contiguous tensor)."""
    layers, two, _, heads, page, dim = tiles.shape
    out = torch.empty(layers, two, heads, tokens, dim, dtype=tiles.dtype, device=tiles.device)
    full = tokens // page
    out[:, :, :, : full * page].unflatten(3, (full, page)).copy_(tiles[:, :, :full].transpose(2, 3))
    if tokens % page:
        out[:, :, :, full * page :].copy_(tiles[:, :, full, :, : tokens % page])
    return out


def slabs(tiles: torch.Tensor) -> list[torch.Tensor]:
    """The ``2 * layers`` messages of a tiled payload, layer-major, K before V (each contiguous)."""
    return [tiles[layer, kv] for layer in range(tiles.shape[0]) for kv in range(tiles.shape[1])]


@dataclass(frozen=True)
class PageTarget:
    """Reserved pages of a paged pool ``kv`` (``[layers, 2, pages, Hkv, WIRE_PAGE, D]``) that a decode-kv
    pull writes into: tile ``i`` of the payload goes to page ``pages[i]``."""

    kv: torch.Tensor
    pages: tuple[int, ...]

    def fits(self, shape: Sequence[int], dtype: str | torch.dtype) -> bool:
        """Whether a payload of logical ``shape`` and ``dtype`` can land in these pages."""
        if len(shape) != 5:
            return False
        layers, two, heads, tokens, dim = shape
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        pool_layers, pool_two, _, pool_heads, page, pool_dim = self.kv.shape
        return (
            (layers, two, heads, dim, page) == (pool_layers, pool_two, pool_heads, pool_dim, WIRE_PAGE)
            and 0 < num_tiles(tokens) <= len(self.pages)
            and name == dtype_name(self.kv.dtype)
        )

    def run(self, n: int) -> slice | None:
        """The first ``n`` pages as one slice of the pool when they are consecutive, else None."""
        first = self.pages[0]
        if list(self.pages[:n]) != list(range(first, first + n)):
            return None
        return slice(first, first + n)

    def slab(self, layer: int, kv: int, n: int) -> torch.Tensor | None:
        """Where one layer's K or V tiles go, as one contiguous tensor (None: the pages are scattered)."""
        run = self.run(n)
        return None if run is None else self.kv[layer, kv, run]

    def write(self, tiles: torch.Tensor) -> None:
        """Copy a whole tiled payload (any device the pool's kernels can read, e.g. CUDA IPC memory)."""
        n = tiles.shape[2]
        run = self.run(n)
        if run is not None:
            self.kv[:, :, run].copy_(tiles)
        else:
            self.kv.index_copy_(2, self._index(n), tiles)

    def write_slab(self, layer: int, kv: int, slab: torch.Tensor) -> None:
        """Scatter one received slab ``[n, Hkv, WIRE_PAGE, D]`` into its pages."""
        n = slab.shape[0]
        dest = self.slab(layer, kv, n)
        if dest is not None:
            dest.copy_(slab)
        else:
            self.kv[layer, kv].index_copy_(0, self._index(n), slab.to(self.kv.device))

    def _index(self, n: int) -> torch.Tensor:
        return torch.tensor(self.pages[:n], device=self.kv.device)
