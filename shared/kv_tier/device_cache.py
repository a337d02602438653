"""A device-resident LRU of hot chunk KV in front of the KV tier (``serve --kv-gpu-bytes``).

A document that comes back finds its chunks here: chunk prefill copies a hit into its bank device to device,
where a host-tier hit costs a copy out of pageable host memory and a transfer over PCIe (about 0.9 GiB for
a 16K-token Dream-7B document). Writes are cloned here on the caller's device and stream (~40 us per chunk
on an H100) and go on, unchanged, to the store below (the background writer, then the host tier and
Redis). A hit below is not copied up: its transfer to the device happens in the bank load anyway.

A hit handed out is marked as used on the reader's current stream (``record_stream``), so evicting it
later never frees memory a queued copy still reads. Values on another device than the cache's are passed
through, not cached.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.stats import KVStats


class DeviceLRU(CPUStore):
    """The CPU tier's LRU by bytes, holding contiguous clones on the values' own device."""

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone(memory_format=torch.contiguous_format)


class DeviceChunkCache:
    """A :class:`DeviceLRU` on ``device`` in front of ``store``; ``stats()`` counts this tier's own hits."""

    def __init__(self, store: KVStore, capacity_bytes: int, device: torch.device, name: str = "gpu") -> None:
        self.store, self.device, self.name = store, device, name
        self.lru = DeviceLRU(CPUStoreConfig(capacity_bytes), name=name)

    @property
    def tiers(self) -> list:
        """This tier, then the store's tiers (and the store itself when it is a writer in front of them)."""
        below = list(getattr(self.store, "tiers", None) or [self.store])
        if self.store not in below:
            below.append(self.store)
        return [self, *below]

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        found = self.lru.get_many(keys)
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for value in found:
                if value is not None:
                    value.record_stream(stream)
        wanted = [i for i, v in enumerate(found) if v is None]
        if wanted:
            for i, value in zip(wanted, self.store.get_many([keys[i] for i in wanted])):
                found[i] = value
        return found

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        self.lru.put_many([(key, value) for key, value in items if value.device == self.device])
        return self.store.put_many(items)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        mine = self.lru.contains_many(keys)
        wanted = [i for i, hit in enumerate(mine) if not hit]
        if wanted:
            for i, hit in zip(wanted, self.store.contains_many([keys[i] for i in wanted])):
                mine[i] = hit
        return mine

    def stats(self) -> KVStats:
        return self.lru.stats()

    def healthy(self) -> bool:
        return self.store.healthy()

    def close(self) -> None:
        self.lru.close()
        self.store.close()
