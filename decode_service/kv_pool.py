"""The decode worker's KV pool: every active session's static KV in fixed-size pages under a byte budget.

One :class:`~pdllm.kernels.paged_kv.PagedKVPool` (``[layers, 2, pages, Hkv, page_size, D]``, the layout the
split-S kernel reads) is allocated once at start. A session reserves the pages its static KV needs when it
is admitted (so a build in progress cannot be starved), fills them when its build ends (a handed-off KV is
received straight into them, consecutive pages preferred: ``shared/kv_transfer/pages.py``), and gives them
back the moment it finishes or is cancelled. Requests that do not fit wait; a request larger than the
whole pool is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdllm.kernels.paged_kv import PagedKVConfig, PagedKVPool
from pdllm.shared.static_kv import StaticKV


@dataclass(frozen=True)
class KVPoolConfig:
    """``budget_bytes``: the pool's size (rounded down to whole pages). ``page_size``: tokens per page."""

    budget_bytes: int
    page_size: int = 64

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"KV pool budget must be positive, got {self.budget_bytes} bytes")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")


@dataclass(frozen=True)
class PooledKV:
    """A session's static KV that is already in its reserved pages (a handoff landed there): only its
    extent, what the session needs to address it."""

    query_start: int
    num_tokens: int


class PoolTooSmallError(ValueError):
    """A request needs more KV than the whole pool holds."""


class DecodeKVPool:
    def __init__(
        self,
        config: KVPoolConfig,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = num_layers * 2 * num_kv_heads * config.page_size * head_dim * elem
        num_pages = config.budget_bytes // self.page_bytes
        if num_pages < 1:
            raise ValueError(
                f"KV pool budget {config.budget_bytes} bytes holds no page of {self.page_bytes} bytes"
            )
        self.config = config
        self.pool = PagedKVPool(
            PagedKVConfig(num_layers, num_kv_heads, head_dim, num_pages, config.page_size, dtype, device)
        )

    @classmethod
    def for_model(cls, model: torch.nn.Module, config: KVPoolConfig) -> DecodeKVPool:
        p = next(model.parameters())
        c = model.config  # type: ignore[attr-defined]
        return cls(config, c.num_layers, c.num_kv_heads, c.head_dim, p.dtype, p.device)

    @classmethod
    def with_pages(cls, model: torch.nn.Module, pages: int, page_size: int) -> DecodeKVPool:
        """A pool of exactly ``pages`` pages of ``page_size`` slots for ``model`` (its layers, KV heads and
        dtype)."""
        p = next(model.parameters())
        c = model.config  # type: ignore[attr-defined]
        page_bytes = c.num_layers * 2 * c.num_kv_heads * page_size * c.head_dim * p.element_size()
        return cls.for_model(model, KVPoolConfig(pages * page_bytes, page_size))

    @property
    def num_pages(self) -> int:
        return self.pool.config.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def kv(self) -> torch.Tensor:
        """The whole pool, ``[layers, 2, pages, Hkv, page_size, D]``."""
        return self.pool.kv

    def pages_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.page_size))

    def check_fits(self, tokens: int) -> None:
        """Raise :class:`PoolTooSmallError` when even an empty pool could not hold ``tokens`` static tokens."""
        need = self.pages_for(tokens)
        if need > self.num_pages:
            raise PoolTooSmallError(
                f"the request needs {need * self.page_bytes} bytes of decode KV ({tokens} tokens); "
                f"this worker's KV pool holds {self.num_pages * self.page_bytes} bytes"
            )

    def reserve(self, tokens: int, run: bool = False) -> list[int] | None:
        """Pages for ``tokens`` static tokens, or None while too few are free (:meth:`check_fits` first).
        ``run``: consecutive pages when some are free (a handoff is received straight into them only
        then, ``shared/kv_transfer/pages.py``), else any."""
        self.check_fits(tokens)
        need = self.pages_for(tokens)
        if need > self.num_free:
            return None
        return (self._take_run(need) if run else None) or self.pool.allocate(need)

    def _take_run(self, need: int) -> list[int] | None:
        """The lowest ``need`` consecutive free pages, taken; None when the free pages hold no such run."""
        free = self.pool._free  # PagedKVPool's free stack; it has no run-aware allocate of its own
        if free[-need:][::-1] == list(range(free[-1], free[-1] + need)):
            return self.pool.allocate(need)  # what allocate pops next is a run already (the usual case)
        ordered = sorted(free)
        start = 0
        for i in range(1, len(ordered) + 1):
            if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
                if i - start >= need:
                    taken = ordered[start : start + need]
                    keep = set(taken)
                    free[:] = [p for p in free if p not in keep]
                    return taken
                start = i
        return None

    def write(self, pages: list[int], static: torch.Tensor) -> None:
        """Fill reserved ``pages`` with a session's static KV ``[layers, 2, Hkv, S, D]`` (S >= 1)."""
        if static.shape[3] == 0:  # nothing static (cannot happen for pdllm: >= 1 chunk); keep page valid
            return
        self.pool.write_chunk(static, pages[: self.pages_for(static.shape[3])])

    def place(self, pages: list[int], static: StaticKV | PooledKV) -> None:
        """Put a session's built static KV into its reserved ``pages`` (pulled KV is there already)."""
        if isinstance(static, StaticKV):
            self.write(pages, static.tensor())

    def release(self, pages: list[int]) -> None:
        if pages:
            self.pool.free(pages)
