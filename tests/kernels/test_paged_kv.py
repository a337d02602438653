from __future__ import annotations

import pytest
import torch

from pdllm.kernels.paged_kv import PagedKVConfig, PagedKVPool, PoolFullError


def _pool(num_pages: int = 8, page_size: int = 4) -> PagedKVPool:
    return PagedKVPool(PagedKVConfig(2, 3, 8, num_pages=num_pages, page_size=page_size, dtype=torch.float32))


def test_write_read_round_trip_and_page_layout() -> None:
    pool = _pool()
    chunk = torch.randn(2, 2, 3, 6, 8)
    where = pool.write_chunk(chunk)
    assert where.pages == (0, 1) and where.num_tokens == 6
    torch.testing.assert_close(pool.read_chunk(where), chunk, rtol=0, atol=0)
    k_pages, _ = pool.layer(1)
    # Token 5 of the chunk, head 2, layer 1 is slot 1 of the second page.
    torch.testing.assert_close(k_pages[1, 2, 1], chunk[1, 0, 2, 5], rtol=0, atol=0)


def test_page_table_concatenates_chunks_with_fill() -> None:
    pool = _pool()
    a = pool.write_chunk(torch.randn(2, 2, 3, 5, 8))
    b = pool.write_chunk(torch.randn(2, 2, 3, 4, 8))
    c = pool.write_chunk(torch.randn(2, 2, 3, 1, 8))
    t = pool.build_page_table([[a, b], [c]])
    assert t.page_table.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert t.page_fill.tolist() == [[4, 1, 4], [1, 0, 0]]
    assert t.kv_lens.tolist() == [12, 4] and t.num_tokens.tolist() == [9, 1]
    assert t.page_table.dtype == torch.int32


def test_free_list_and_errors() -> None:
    pool = _pool(num_pages=3)
    a = pool.write_chunk(torch.randn(2, 2, 3, 8, 8))
    with pytest.raises(PoolFullError):
        pool.write_chunk(torch.randn(2, 2, 3, 8, 8))
    pool.free(a)
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="not an allocated page"):
        pool.free(a)
    with pytest.raises(ValueError, match="chunk KV must be"):
        pool.write_chunk(torch.randn(2, 2, 4, 8, 8))
    with pytest.raises(ValueError, match="power of two"):
        PagedKVConfig(1, 1, 8, num_pages=1, page_size=6)
