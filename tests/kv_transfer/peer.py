"""The other process of the two-process transfer tests (``python -m tests.kv_transfer.peer``).

``send [--die-in-send]``: build the decode KV of a fixed request on the tiny model, offer it, serve
``KvTransfer`` and print ``READY <address> <base64 handoff>``; with ``--die-in-send`` the process exits the
moment it starts sending (a sender killed mid-transfer). ``pull-and-vanish <address> <base64 handoff>``:
connect, ask for the send, exit without receiving (a receiver gone mid-transfer).
"""

from __future__ import annotations

import base64
import os
import sys
import time

import grpc
import torch

from pdllm.decode_service.kv_receiver import KvReceiver
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.config import EngineConfig
from pdllm.shared.kv_transfer import KvSender, SenderConfig, TransferConfig
from pdllm.shared.kv_transfer.pairs import PairGroup
from pdllm.shared.kv_transfer.payload import pack_static
from pdllm.shared.layout import Request, decode_layout
from pdllm.shared.rpc.server import ServerConfig, build_server, service_spec
from tests.engine.helpers import model, tokens

CONFIG = TransferConfig("gloo", timeout_s=5)


def fixed_build() -> torch.Tensor:
    """The decode KV both processes build for the same request (tiny model, seed 0, fp32)."""
    request = Request(
        instruction=tokens(3, 9), chunks=[[1, *tokens(11, i)] for i in range(4)], query=tokens(5, 2)
    )
    static = DecodeWorker(model("dream")).build(
        request, decode_layout(request, [0, 2], 6), EngineConfig(top_b=7)
    )
    return pack_static(static)[0]


def send(die: bool) -> None:
    if die:
        PairGroup.send = lambda self, tensor: os._exit(3)  # type: ignore[method-assign]
    sender = KvSender(SenderConfig(CONFIG), torch.device("cpu"))
    spec = service_spec(sender, workers_pb2_grpc.add_KvTransferServicer_to_server, "pdllm.v1.KvTransfer")
    server = build_server(ServerConfig(role="prefill"), [spec]).start()
    handoff = sender.offer(fixed_build(), wpb.KvHandoff(payload="decode-kv"))
    assert handoff is not None
    handoff.sender = server.address
    print("READY", server.address, base64.b64encode(handoff.SerializeToString()).decode(), flush=True)
    sys.stdin.read()  # until the test closes our stdin


def pull_and_vanish(address: str, encoded: str) -> None:
    handoff = wpb.KvHandoff.FromString(base64.b64decode(encoded))
    receiver = KvReceiver(CONFIG, grpc.insecure_channel, torch.device("cpu"))
    peer = receiver._peer(address)
    receiver._connect(address, peer)
    request = wpb.KvSendRequest(
        transfer_id=handoff.transfer_id, receiver_id=receiver.receiver_id, epoch=peer.epoch
    )
    receiver._stub(address).Send(request, timeout=5)
    time.sleep(0.2)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send("--die-in-send" in sys.argv)
    else:
        pull_and_vanish(sys.argv[2], sys.argv[3])
