"""The decode worker's side of a KV handoff: where a pull lands, and what the request's build starts from.

A decode-kv pull (full-mask, chunk-query) lands straight in the pool pages the scheduler reserved for the
request before the pull started (:func:`pull_target`; ``shared/kv_transfer/pages.py`` says how each
transport writes them), so its build step has nothing left to do: the session joins the rounds over a
:class:`~.kv_pool.PooledKV`. A chunk-kv pull (chunk-only) is the build's input (K re-rotated, the
instruction encoded, top-B compacting), so it arrives in a tensor of its own, as does a decode KV the pool
cannot take in place (another page size than the wire's tiles).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdllm.decode_service.kv_pool import DecodeKVPool, PooledKV
from pdllm.decode_service.kv_receiver import KvReceiver, Transfer, TransferState
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.kv_transfer.pages import WIRE_PAGE, PageTarget
from pdllm.shared.kv_transfer.payload import DECODE_KV, unpack_segments, unpack_static
from pdllm.shared.layout import DecodeLayout
from pdllm.shared.static_kv import StaticKV

_log = logging.getLogger("pdllm.decode.handoff")


def pull_target(pool: DecodeKVPool, handoff: wpb.KvHandoff, pages: list[int]) -> PageTarget | None:
    """The reserved ``pages`` as the landing place of ``handoff``'s decode KV; None (a tensor of its own)
    for chunk KV, or when the pool's pages are not the wire's tiles or the KV does not fit them."""
    if handoff.payload != DECODE_KV or pool.page_size != WIRE_PAGE or not pages:
        return None
    target = PageTarget(pool.kv, tuple(pages))
    return target if target.fits(tuple(handoff.shape), handoff.dtype) else None


def start_pull(
    receiver: KvReceiver, pool: DecodeKVPool, handoff: wpb.KvHandoff, pages: list[int]
) -> Transfer:
    return receiver.start(handoff, pull_target(pool, handoff, pages))


@dataclass
class Pulled:
    """What a request's build starts from. ``source``: the trace's ``kv_source``; ``static``: the decode KV
    when the pull delivered one that fits (no build); ``local``: the selected chunks' KV (chunk-only)."""

    source: str
    static: StaticKV | PooledKV | None = None
    local: list[torch.Tensor] = field(default_factory=list)


def use_pulled(pulled: Transfer | None, layout: DecodeLayout, kv_tokens: int) -> Pulled:
    """``pulled``: the request's finished pull (None: there was none); ``kv_tokens``: the static tokens its
    pages were reserved for."""
    if pulled is None:
        return Pulled("built")
    if pulled.state is not TransferState.DONE:
        return Pulled("handoff-failed-rebuilt")
    h = pulled.handoff
    kv, pulled.kv = pulled.kv, None  # the session keeps what it uses; the finished pull holds no copy
    if h.payload != DECODE_KV:
        return Pulled("handoff", local=unpack_segments(kv, h.segment_lens)) if kv is not None else _rebuild()
    tokens = int(h.shape[3])
    if tokens > kv_tokens or h.query_start != layout.static_len or sum(h.segment_lens) != tokens:
        return _rebuild()
    if pulled.landed:
        return Pulled("handoff", PooledKV(h.query_start, tokens))
    return Pulled("handoff", unpack_static(kv, h)) if kv is not None else _rebuild()


def _rebuild() -> Pulled:
    _log.warning("handed-off KV does not fit the request's chunks; rebuilding it")
    return Pulled("handoff-failed-rebuilt")
