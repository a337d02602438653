"""A pulled decode KV lands straight in the decode worker's reserved pool pages (Gloo on loopback, CPU pool).

The sender holds a decode-kv payload in page tiles and sends it as one message per layer and K/V; the
receiver posts each recv on the pool slab of its reserved pages. The tests check where Gloo wrote (every
recv buffer is the pool itself, at the reserved pages), that no byte went through a buffer, and that the
pages then hold exactly what the decode worker's own ``pool.write`` of its local build holds; scattered
pages go through one slab-sized buffer only; a cancelled pull gives its pages back only when safe.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from pdllm.decode_service.handoff import pull_target
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig
from pdllm.decode_service.kv_receiver import KvReceiver, Transfer, TransferState
from pdllm.decode_service.worker import DecodeWorker
from pdllm.kernels.paged_kv import ChunkPages
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.config import EngineConfig
from pdllm.shared.kv_transfer import KvSender, SenderConfig
from pdllm.shared.kv_transfer.pages import (
    WIRE_PAGE,
    PageTarget,
    num_tiles,
    slabs,
    tiled_shape,
    to_tiles,
    untile,
)
from pdllm.shared.kv_transfer.pairs import PairGroup
from pdllm.shared.kv_transfer.payload import pack_static
from pdllm.shared.layout import Request, decode_layout
from pdllm.shared.rpc.server import ServerConfig, build_server, service_spec
from tests.engine.helpers import model, tokens
from tests.kv_transfer.peer import CONFIG


def local_build() -> torch.Tensor:
    """A decode KV the decode worker builds itself (tiny model, fp32): 3 + 2 x 81 tokens, three pages."""
    request = Request(
        instruction=tokens(3, 9), chunks=[[1, *tokens(80, i)] for i in range(3)], query=tokens(5, 2)
    )
    static = DecodeWorker(model("dream")).build(request, decode_layout(request, [0, 2], 6), EngineConfig())
    return pack_static(static)[0]


@pytest.fixture(scope="module")
def local():  # type: ignore[no-untyped-def]
    """The locally built decode KV, an in-process sender serving it, and a receiver."""
    sender = KvSender(SenderConfig(CONFIG), torch.device("cpu"))
    spec = service_spec(sender, workers_pb2_grpc.add_KvTransferServicer_to_server, "pdllm.v1.KvTransfer")
    server = build_server(ServerConfig(role="prefill"), [spec]).start()
    receiver = KvReceiver(CONFIG, grpc.insecure_channel, torch.device("cpu"))
    yield local_build(), sender, server.address, receiver
    receiver.close()
    sender.close()
    server.stop()


def _pool(kv: torch.Tensor, pages: int = 12) -> DecodeKVPool:
    layers, _, heads, _, dim = kv.shape
    page_bytes = layers * 2 * heads * WIRE_PAGE * dim * kv.element_size()
    return DecodeKVPool(KVPoolConfig(pages * page_bytes), layers, heads, dim, kv.dtype, "cpu")


def _offer(sender: KvSender, address: str, kv: torch.Tensor) -> wpb.KvHandoff:
    handoff = sender.offer(kv, wpb.KvHandoff(payload="decode-kv", segment_lens=[kv.shape[3]]))
    assert handoff is not None
    handoff.sender = address
    return handoff


def _pages_hold(pool: DecodeKVPool, pages: list[int], kv: torch.Tensor) -> bool:
    """Whether ``pages`` hold bit for bit what ``pool.write`` of ``kv`` (the local build's path) puts there,
    the zeroed tail of the last page included."""
    n = num_tiles(kv.shape[3])
    reference = _pool(kv)
    reference.write(list(range(n)), kv)
    return torch.equal(pool.kv[:, :, pages[:n]], reference.kv[:, :, :n]) and torch.equal(
        pool.pool.read_chunk(ChunkPages(tuple(pages[:n]), kv.shape[3])), kv
    )


def test_tiles_are_the_pool_layout_and_round_trip() -> None:
    for t in (1, 63, 64, 65, 130):
        kv = torch.randn(2, 2, 3, t, 8)
        tiles = to_tiles(kv)
        assert tiles.shape == tiled_shape(kv.shape) and tiles.is_contiguous()
        assert torch.equal(untile(tiles, t), kv)
        for pages in ([4, 5, 6], [6, 2, 9]):  # a run, scattered
            pool = _pool(kv)
            pool.kv.fill_(7.0)
            target = PageTarget(pool.kv, tuple(pages))
            assert target.fits(kv.shape, kv.dtype) == (num_tiles(t) <= len(pages))
            if not target.fits(kv.shape, kv.dtype):
                continue
            target.write(tiles)
            assert _pages_hold(pool, pages, kv)
            pool.kv.fill_(7.0)
            for i, slab in enumerate(slabs(tiles)):
                target.write_slab(*divmod(i, 2), slab)
            assert _pages_hold(pool, pages, kv)
    assert not PageTarget(pool.kv, (0,)).fits(kv.shape, torch.float16)


def test_pulled_kv_is_received_straight_into_the_reserved_pages(local, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    kv, sender, address, receiver = local
    pool = _pool(kv)
    pool.reserve(3 * WIRE_PAGE)  # pages 0-2 belong to another session: the target starts mid-pool
    pages = pool.reserve(kv.shape[3] + 100, run=True)  # the request's bound (top-B kept fewer tokens)
    assert pages is not None and pages[0] == 3
    handoff = _offer(sender, address, kv)
    target = pull_target(pool, handoff, pages)
    assert target is not None
    dests: list[torch.Tensor] = []
    recv_one = PairGroup._recv_one

    def spy(self: PairGroup, dest: torch.Tensor, tag: int) -> None:
        dests.append(dest)
        recv_one(self, dest, tag)

    monkeypatch.setattr(PairGroup, "_recv_one", spy)
    transfer = receiver.start(handoff, target)
    assert transfer.wait(30) and transfer.state is TransferState.DONE, transfer.error
    assert transfer.landed and transfer.kv is None and transfer.staged_bytes == 0
    n = num_tiles(kv.shape[3])
    layers = kv.shape[0]
    # Gloo wrote every message into the pool itself, each at its layer's K or V slab of the reserved pages.
    assert [d.data_ptr() for d in dests] == [
        pool.kv[layer, k, pages[0]].data_ptr() for layer in range(layers) for k in range(2)
    ]
    assert all(d.untyped_storage().data_ptr() == pool.kv.untyped_storage().data_ptr() for d in dests)
    assert sum(d.nbytes for d in dests) == n * pool.page_bytes  # and nothing else was received
    assert _pages_hold(pool, pages, kv)


def test_scattered_pages_take_one_slab_buffer_not_a_staging_copy(local) -> None:  # type: ignore[no-untyped-def]
    kv, sender, address, receiver = local
    n = num_tiles(kv.shape[3])
    pool = _pool(kv, pages=2 * n)
    held = [pool.reserve(WIRE_PAGE) for _ in range(2 * n)]
    for page in held[1::2]:
        pool.release(page)  # free pages 1, 3, 5: no run of two
    pages = pool.reserve(n * WIRE_PAGE, run=True)
    assert pages is not None and PageTarget(pool.kv, tuple(pages)).run(n) is None
    transfer = receiver.start(_offer(sender, address, kv), PageTarget(pool.kv, tuple(pages)))
    assert transfer.wait(30) and transfer.state is TransferState.DONE, transfer.error
    assert transfer.landed and transfer.kv is None
    assert transfer.staged_bytes == to_tiles(kv).nbytes  # each slab once through the one buffer
    assert _pages_hold(pool, pages, kv)


def test_without_a_target_the_pull_is_a_tensor_of_its_own(local) -> None:  # type: ignore[no-untyped-def]
    kv, sender, address, receiver = local
    transfer = receiver.start(_offer(sender, address, kv))
    assert transfer.wait(30) and transfer.state is TransferState.DONE, transfer.error
    assert not transfer.landed and torch.equal(transfer.kv, kv)


def test_a_cancelled_pull_frees_its_pages_only_when_nothing_writes_them(local) -> None:  # type: ignore[no-untyped-def]
    kv, sender, address, receiver = local
    pool = _pool(kv)
    pages = pool.reserve(kv.shape[3], run=True)
    target = PageTarget(pool.kv, tuple(pages))  # type: ignore[arg-type]
    handoff = _offer(sender, address, kv)
    late = Transfer(handoff, target)
    assert late.detach()  # not started: its pages may go at once ...
    pool.kv.fill_(7.0)  # (as if another request had them now)
    receiver._pull(late)  # ... and a detached pull that starts afterwards writes nothing
    assert late.state is TransferState.FAILED and "cancelled" in late.error
    assert bool((pool.kv == 7.0).all())
    started = Transfer(handoff, target)
    started._claim()
    assert not started.detach()  # writing: its pages stay reserved until it has finished
    started.state = TransferState.DONE
    assert started.detach()
