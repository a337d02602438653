"""How many bytes of host memory a server's CPU tier of chunk KV may hold (``serve --kv-cpu-bytes``).

``auto`` (the default) sizes it from the memory the host has available at startup, so documents that come
back are served from memory without a flag: a 16K-token document's chunk KV is ~0.9 GiB at Dream-7B shapes
in bf16, and a fixed 2 GiB held two. The tier's memory is pageable at any size: the pinned memory it uses is
a fixed staging ring (``kv_tier/staging.py``), so this size costs no ``cudaHostAlloc``. Pure Python (no
torch), so ``serve --help`` loads fast.
"""

from __future__ import annotations

import re
from pathlib import Path

AUTO_SHARE = 0.4  # of MemAvailable: the rest stays for the model load, the builds and the OS page cache
AUTO_FLOOR = 1 << 30  # a host that reports less gets this much (or what it has, if even less)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's MemAvailable in bytes (Linux), None where it cannot be read."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def auto_bytes(available: int | None) -> int:
    """``AUTO_SHARE`` of ``available`` (at least ``AUTO_FLOOR``, never more than ``available``); 2 GiB when
    the host does not say."""
    if available is None:
        return 2 << 30
    return min(available, max(AUTO_FLOOR, int(available * AUTO_SHARE))) >> 20 << 20


def parse_bytes(value: str, available: int | None = None) -> int:
    """``"auto"``, or a byte count with an optional binary suffix (``"512M"``, ``"64G"``, ``"2147483648"``);
    0 means none. ``available``: the host's available bytes for ``auto`` (default: read now)."""
    raw = value.strip().lower()
    if raw == "auto":
        return auto_bytes(available if available is not None else available_bytes())
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", raw)
    if not match:
        raise ValueError(f"expected 'auto' or a size such as 2147483648, 512M or 64G; got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
