"""The oracle tests run tiny fp32 forwards on the CPU, on one thread (on a busy 2-core box an idle OpenMP
worker's spin-waiting makes such forwards many times slower); each module restores the previous setting."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
