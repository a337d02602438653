"""Background KV writer: writes leave the caller at once, reads see queued values, overflow drops and
counts, backend failures lose one value only, close writes what is queued."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.writer import BackgroundKVWriter, KVWriterConfig
from tests.kv_tier.helpers import bitwise_equal, chunk_kv, meta, nbytes


class GatedStore(CPUStore):
    """A CPU store whose puts wait for ``gate`` (a slow backend) and can be told to fail."""

    def __init__(self) -> None:
        super().__init__(CPUStoreConfig(capacity_bytes=1 << 24, pin_memory=False))
        self.gate = threading.Event()
        self.keys_seen: list[str] = []
        self.entered = threading.Event()
        self.fail_keys: set[str] = set()
        self.held_at_close: list[str] | None = None

    def close(self) -> None:
        self.held_at_close = [k for k, hit in zip(self.keys_seen, self.contains_many(self.keys_seen)) if hit]
        super().close()

    def put_many(self, items):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.keys_seen.extend(key for key, _ in items)
        assert self.gate.wait(10), "test never opened the gate"
        if any(key in self.fail_keys for key, _ in items):
            raise ConnectionError("backend down")
        return super().put_many(items)


def writer_over(inner: KVStore, max_pending_bytes: int = 1 << 24) -> BackgroundKVWriter:
    return BackgroundKVWriter(inner, KVWriterConfig(max_pending_bytes=max_pending_bytes, pin_memory=False))


def returns_within(fn, seconds: float = 5.0):  # type: ignore[no-untyped-def]
    """Runs ``fn`` on a thread; fails the test if it has not returned in time (it blocked)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call blocked on the backend"
    return box[0]


def test_put_returns_while_the_backend_is_stuck_and_reads_see_the_queue() -> None:
    inner = GatedStore()
    writer = writer_over(inner)
    assert isinstance(writer, KVStore)
    values = {f"k{i}": chunk_kv(meta(), 4 + i, seed=i) for i in range(3)}
    originals = {k: v.clone() for k, v in values.items()}
    assert returns_within(lambda: writer.put_many(list(values.items()))) == 3
    for tensor in values.values():
        tensor.add_(1)  # the caller reusing its buffers must not change what gets written
    assert inner.entered.wait(5)
    got = writer.get_many(["k0", "k1", "k2", "nope"])
    assert got[3] is None and all(bitwise_equal(g, originals[k]) for g, k in zip(got, ["k0", "k1", "k2"]))
    assert writer.contains_many(["k2", "nope"]) == [True, False]
    assert writer.stats().resident_values == 3
    assert inner.contains_many(["k0", "k1", "k2"]) == [False, False, False]

    inner.gate.set()
    assert writer.flush(10)
    assert all(bitwise_equal(inner.get_many([k])[0], originals[k]) for k in originals)
    stats = writer.stats()
    assert (stats.puts, stats.put_failures, stats.resident_bytes, stats.resident_values) == (3, 0, 0, 0)
    assert stats.bytes_written == sum(nbytes(v) for v in originals.values())
    writer.close()


def test_a_full_queue_drops_and_counts_instead_of_waiting() -> None:
    inner = GatedStore()
    one = chunk_kv(meta(), 8)
    writer = writer_over(inner, max_pending_bytes=2 * nbytes(one))
    assert returns_within(lambda: writer.put_many([(f"k{i}", one) for i in range(3)])) == 2
    assert writer.get_many(["k2"]) == [None]
    assert writer.stats().put_failures == 1 and writer.stats().resident_bytes == 2 * nbytes(one)
    inner.gate.set()
    assert writer.flush(10)
    assert writer.put_many([("k2", one)]) == 1  # room again once written
    assert writer.flush(10) and inner.contains_many(["k0", "k1", "k2"]) == [True, True, True]
    writer.close()


def test_a_backend_failure_loses_that_value_only() -> None:
    inner = GatedStore()
    inner.fail_keys = {"bad"}
    inner.gate.set()
    writer = writer_over(inner)
    writer.put_many([("bad", chunk_kv(meta(), 3)), ("good", chunk_kv(meta(), 3, seed=1))])
    assert writer.flush(10)
    assert writer.get_many(["bad"]) == [None] and writer.get_many(["good"])[0] is not None
    stats = writer.stats()
    assert (stats.puts, stats.put_failures, stats.errors, stats.resident_bytes) == (1, 1, 1, 0)
    assert writer.healthy()
    writer.close()


def test_rewriting_a_key_while_it_is_written_keeps_the_byte_count_exact() -> None:
    inner = GatedStore()
    writer = writer_over(inner)
    first, second = chunk_kv(meta(), 4, seed=1), chunk_kv(meta(), 6, seed=2)
    writer.put_many([("k", first)])
    assert inner.entered.wait(5)  # the thread holds "k" now
    writer.put_many([("k", second)])
    assert bitwise_equal(writer.get_many(["k"])[0], second)
    inner.gate.set()
    assert writer.flush(10)
    assert bitwise_equal(inner.get_many(["k"])[0], second)
    assert writer.stats().resident_bytes == 0 and writer.stats().resident_values == 0
    writer.close()


def test_close_writes_what_is_queued_and_then_drops() -> None:
    inner = GatedStore()
    writer = writer_over(inner)
    writer.put_many([(f"k{i}", chunk_kv(meta(), 3, seed=i)) for i in range(4)])
    assert inner.entered.wait(5)
    threading.Timer(0.2, inner.gate.set).start()  # the backend answers only after close() began
    writer.close()
    assert inner.held_at_close == [f"k{i}" for i in range(4)]
    assert writer.put_many([("late", chunk_kv(meta(), 3))]) == 0
    assert not writer.healthy()


def test_serve_puts_the_writer_in_front_of_the_tiers_unless_asked_not_to() -> None:
    from pdllm.shared.app.serve import _kv_store
    from tests.model.helpers import tiny_config

    config = argparse.Namespace(kv_url="", kv_cpu_bytes=1 << 20, kv_write_queue_bytes=1 << 20, kv_gpu_bytes=0)
    model_config = tiny_config()
    store = _kv_store(config, model_config, "float32")
    assert isinstance(store, BackgroundKVWriter) and isinstance(store.store, CPUStore)
    assert store.tiers == [store.store] and not store.store.config.copy_on_put
    store.close()
    plain = _kv_store(
        argparse.Namespace(**{**vars(config), "kv_write_queue_bytes": 0}), model_config, "float32"
    )
    assert isinstance(plain, CPUStore) and plain.config.copy_on_put
    with pytest.raises(ValueError, match="kv-write-queue-bytes"):
        _kv_store(argparse.Namespace(**{**vars(config), "kv_write_queue_bytes": -1}), model_config, "float32")


def test_writer_values_are_private_copies_on_the_callers_device() -> None:
    writer = writer_over(GatedStore())
    tensor = chunk_kv(meta(torch.bfloat16), 5)
    writer.put_many([("k", tensor)])
    queued = writer.get_many(["k"])[0]
    assert queued.data_ptr() != tensor.data_ptr() and queued.device == tensor.device
    writer.store.gate.set()  # type: ignore[attr-defined]
    writer.close()
