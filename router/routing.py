"""Which worker gets a request: document affinity for prefill, least load for decode.

A prefill worker that already prefilled a document holds its chunk KV in its in-process tier, so the
same document (content hash of its context ids) goes back to it while it is healthy and not far busier than
the least loaded worker (its queue beyond the least loaded one's within ``affinity_slack`` times the
request's own tokens: a hit saves about one prefill of the request, a long queue costs more); otherwise the
worker with the fewest outstanding prompt tokens wins. Decode goes to the worker with the fewest
requests in flight. Ties break by address so routing is deterministic in tests.

Where a pdllm request's decode KV is built (:func:`build_on_prefill`): on the decode worker (the KV never
moves, but the build's forward stalls every stream that worker is decoding) or on the prefill worker, which
then hands the KV off (``pdllm.shared.kv_transfer``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

BUILD_PLACEMENTS = ("auto", "decode", "prefill")


def build_on_prefill(placement: str, prefill_queued_tokens: int, decode_in_flight: int) -> bool:
    """Whether the prefill worker builds the decode KV. "auto": yes while the decode worker is decoding
    other requests (its rounds would wait for the build) and the prefill worker has no other prompt in
    flight (the build would delay it); otherwise the decode worker builds, which moves no KV."""
    if placement not in BUILD_PLACEMENTS:
        raise ValueError(f"build placement must be one of {BUILD_PLACEMENTS}, got {placement!r}")
    if placement != "auto":
        return placement == "prefill"
    return decode_in_flight > 0 and prefill_queued_tokens == 0


def document_key(context_ids: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(len(context_ids).to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in context_ids))
    return h.hexdigest()


@dataclass
class LoadTracker:
    """Outstanding work per worker address (tokens for prefill, requests for decode)."""

    affinity_capacity: int = 4096
    # an owner whose queue exceeds the least loaded worker's by more than this many times the request's
    # tokens loses the request to that worker (which then holds the document too)
    affinity_slack: float = 4.0
    _load: dict[str, int] = field(default_factory=dict)
    _affinity: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(
        self,
        candidates: Sequence[str],
        doc: str | None = None,
        exclude: set[str] | None = None,
        tokens: int = 0,
    ) -> str:
        """Pick a worker among ``candidates`` (minus ``exclude``) for a request of ``tokens`` (its document
        ``doc``); raises LookupError if none is left."""
        pool = sorted(set(candidates) - (exclude or set()))
        if not pool:
            raise LookupError("no healthy worker")
        with self._lock:
            least = min(pool, key=lambda a: (self._load.get(a, 0), a))
            if doc is not None:
                owner = self._affinity.get(doc)
                if owner in pool:
                    self._affinity.move_to_end(doc)
                    excess = self._load.get(owner, 0) - self._load.get(least, 0)
                    if excess <= self.affinity_slack * tokens:
                        return owner
            return least

    def remember(self, doc: str, address: str) -> None:
        with self._lock:
            self._affinity[doc] = address
            self._affinity.move_to_end(doc)
            while len(self._affinity) > self.affinity_capacity:
                self._affinity.popitem(last=False)

    @contextmanager
    def outstanding(self, address: str, amount: int) -> Iterator[None]:
        with self._lock:
            self._load[address] = self._load.get(address, 0) + amount
        try:
            yield
        finally:
            with self._lock:
                self._load[address] -= amount

    def load(self, address: str) -> int:
        with self._lock:
            return self._load.get(address, 0)
