"""A paged pool for chunk KV, in the layout the split-S decode kernel reads.

Storage is one tensor ``[num_layers, 2, num_pages, Hkv, page_size, D]`` (index 0 = K, 1 = V). For a
layer, ``k_pages = pool.kv[layer, 0]`` is ``[num_pages, Hkv, page_size, D]``: the ``page_size x D`` tile
of one (page, head) is contiguous, so a kernel block that stays inside a page streams it with full-width
coalesced loads.

A chunk of ``T`` tokens (chunk KV layout ``[num_layers, 2, Hkv, T, D]``, see the lead's interfaces) takes
``ceil(T / page_size)`` pages; its last page may be partly filled. A request's page table concatenates the
pages of its selected chunks; ``page_fill`` says how many leading slots of each page hold real tokens, so
the holes left by partial pages are masked instead of compacted (chunks are written once and shared).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolFullError(RuntimeError):
    """The pool has fewer free pages than asked for."""


@dataclass(frozen=True)
class PagedKVConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.num_pages) <= 0:
            raise ValueError("num_layers, num_kv_heads, head_dim and num_pages must be positive")


@dataclass(frozen=True)
class ChunkPages:
    """Where one chunk lives in the pool: its pages in order and its token count."""

    pages: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class PageTable:
    """Per-request addressing handed to the kernel (all int32, on the pool's device)."""

    page_table: torch.Tensor  # [B, max_pages]
    page_fill: torch.Tensor  # [B, max_pages], valid slots per page (0 past the request's pages)
    kv_lens: torch.Tensor  # [B], logical slots = pages * page_size (holes included)
    num_tokens: torch.Tensor  # [B], real tokens


class PagedKVPool:
    """Fixed-size page pool with a free list; chunk writes and page-table building."""

    def __init__(self, config: PagedKVConfig) -> None:
        self.config = config
        c = config
        self.kv = torch.empty(
            c.num_layers,
            2,
            c.num_pages,
            c.num_kv_heads,
            c.page_size,
            c.head_dim,
            dtype=c.dtype,
            device=c.device,
        )
        # Pop from the end so pages are handed out in ascending order (easier to read in tests).
        self._free: list[int] = list(range(c.num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_pages, v_pages)`` views of one layer, each ``[num_pages, Hkv, page_size, D]``."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolFullError(f"asked for {n} pages, {len(self._free)} free of {self.config.num_pages}")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: ChunkPages | list[int] | tuple[int, ...]) -> None:
        ids = pages.pages if isinstance(pages, ChunkPages) else tuple(pages)
        free_set = set(self._free)
        for p in ids:
            if not 0 <= p < self.config.num_pages or p in free_set:
                raise ValueError(f"page {p} is not an allocated page of this pool")
            free_set.add(p)
        self._free.extend(reversed(ids))

    def write_chunk(self, chunk_kv: torch.Tensor, pages: list[int] | None = None) -> ChunkPages:
        """Copy a chunk ``[num_layers, 2, Hkv, T, D]`` into ``pages`` (allocated earlier, exactly as many as
        it needs) or, when None, into freshly allocated pages."""
        c = self.config
        expect = (c.num_layers, 2, c.num_kv_heads)
        if chunk_kv.dim() != 5 or tuple(chunk_kv.shape[:3]) != expect or chunk_kv.shape[4] != c.head_dim:
            raise ValueError(
                f"chunk KV must be [num_layers={c.num_layers}, 2, Hkv={c.num_kv_heads}, T, D={c.head_dim}], "
                f"got {tuple(chunk_kv.shape)}"
            )
        t = chunk_kv.shape[3]
        if t == 0:
            raise ValueError("cannot store an empty chunk")
        n_pages = -(-t // c.page_size)
        if pages is None:
            pages = self.allocate(n_pages)
        elif len(pages) != n_pages:
            raise ValueError(f"a chunk of {t} tokens needs {n_pages} pages, got {len(pages)}")
        padded = chunk_kv.new_zeros(*expect, n_pages * c.page_size, c.head_dim)
        padded[:, :, :, :t] = chunk_kv
        # [L, 2, Hkv, n_pages, page, D] -> [L, 2, n_pages, Hkv, page, D]
        tiles = padded.view(*expect, n_pages, c.page_size, c.head_dim).transpose(2, 3)
        index = torch.tensor(pages, device=self.kv.device)
        self.kv.index_copy_(2, index, tiles.to(device=self.kv.device, dtype=self.kv.dtype))
        return ChunkPages(tuple(pages), t)

    def read_chunk(self, chunk: ChunkPages) -> torch.Tensor:
        """Inverse of :meth:`write_chunk` (for tests and for moving a chunk out of the pool)."""
        c = self.config
        index = torch.tensor(chunk.pages, device=self.kv.device)
        tiles = self.kv.index_select(2, index).transpose(2, 3)
        flat = tiles.reshape(c.num_layers, 2, c.num_kv_heads, len(chunk.pages) * c.page_size, c.head_dim)
        return flat[:, :, :, : chunk.num_tokens]

    def build_page_table(self, requests: list[list[ChunkPages]]) -> PageTable:
        """One row per request: its chunks' pages concatenated in the given order."""
        if not requests:
            raise ValueError("need at least one request")
        ps = self.config.page_size
        rows: list[list[int]] = []
        fills: list[list[int]] = []
        for chunks in requests:
            pages: list[int] = []
            fill: list[int] = []
            for ch in chunks:
                pages.extend(ch.pages)
                full = [ps] * len(ch.pages)
                full[-1] = ch.num_tokens - ps * (len(ch.pages) - 1)
                fill.extend(full)
            rows.append(pages)
            fills.append(fill)
        width = max(1, max(len(r) for r in rows))
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        fill_t = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, (r, f) in enumerate(zip(rows, fills)):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
            fill_t[i, : len(f)] = torch.tensor(f, dtype=torch.int32)
        dev = self.kv.device
        kv_lens = torch.tensor([len(r) * ps for r in rows], dtype=torch.int32)
        return PageTable(
            page_table=table.to(dev),
            page_fill=fill_t.to(dev),
            kv_lens=kv_lens.to(dev),
            num_tokens=fill_t.sum(1, dtype=torch.int32).to(dev),
        )
