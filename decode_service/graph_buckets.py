"""What both kinds of decode-round CUDA graphs share: the padded sizes a shape is rounded up to (powers of
two, :func:`fine` and :func:`eighths` steps, :func:`query_bucket` for a session's rows, :func:`token_bucket`
for packed tokens) and :func:`capture_graph`, which warms a call up outside any capture and then captures it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _leading_bits(n: int, bits: int, floor: int) -> int:
    """Smallest ``m * 2**k >= n`` with ``m`` a ``bits``-bit number, and at least ``floor``."""
    return floor if n <= floor else _round_up(n, 1 << max(0, n.bit_length() - bits))


def fine(n: int, floor: int = 1) -> int:
    """Smallest ``m * 2**k >= n`` with ``16 <= m < 32`` (at most 1/16 padding), and at least ``floor``."""
    return _leading_bits(n, 5, floor)


def eighths(n: int, floor: int = 16) -> int:
    """Smallest ``m * 2**k >= n`` with ``8 <= m < 16`` (at most 1/8 padding), and at least ``floor``."""
    return _leading_bits(n, 4, floor)


def query_bucket(n: int) -> int:
    """A session's longest row count, padded: a multiple of 4 up to 64, of 8 up to 256, then :func:`fine`.
    The split-S kernel sizes its row blocks (and so its work per KV tile) from it: a power of two would
    double the work of 33-row dual-cache sessions (measured 2.7x on an H100, decode_engine_profile.txt)."""
    if n <= 64:
        return max(4, _round_up(n, 4))
    return _round_up(n, 8) if n <= 256 else fine(n)


def token_bucket(n: int) -> int:
    """Packed tokens, padded: a multiple of 32 up to 1024 (GEMM row counts), then :func:`fine`."""
    return max(32, _round_up(n, 32)) if n <= 1024 else fine(n)


def capture_graph(
    fn: Callable[[], T], device: torch.device, mempool: tuple | None, warm: Callable[[], object] | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """``warm`` (default ``fn``) once on a side stream, where Triton compiles and autotunes outside any
    capture, then ``fn`` captured into ``mempool``: the graph and what the captured call returned."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        (warm or fn)()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    gc.disable()  # no graph may be destroyed by the collector in the middle of this capture
    try:
        with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
            out = fn()
    finally:
        gc.enable()
    return graph, out
