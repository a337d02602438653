"""The transfer between two real processes on loopback (Gloo): bit-exact KV, and the faults a fleet sees
(sender killed mid-transfer, receiver gone, offers expired or over budget) end cleanly and in time."""

from __future__ import annotations

import base64
import subprocess
import sys
import time

import grpc
import pytest
import torch

from pdllm.decode_service.kv_receiver import KvReceiver, TransferState
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.kv_transfer import KvSender, SenderConfig
from pdllm.shared.rpc.server import ServerConfig, build_server, service_spec
from tests.kv_transfer.peer import CONFIG, fixed_build

PEER = [sys.executable, "-m", "tests.kv_transfer.peer"]


def _sender_process(*flags: str) -> tuple[subprocess.Popen, wpb.KvHandoff]:
    proc = subprocess.Popen([*PEER, "send", *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()  # type: ignore[union-attr]
    assert line and line[0] == "READY", line
    return proc, wpb.KvHandoff.FromString(base64.b64decode(line[2]))


def _pull(handoff: wpb.KvHandoff, receiver: KvReceiver) -> tuple:  # type: ignore[type-arg]
    transfer = receiver.start(handoff)
    assert transfer.wait(30), "a pull must end (done or failed) within its timeout"
    return transfer, transfer.seconds


def test_pulled_kv_equals_the_receivers_own_build_bit_for_bit() -> None:
    proc, handoff = _sender_process()
    receiver = KvReceiver(CONFIG, grpc.insecure_channel, torch.device("cpu"))
    try:
        transfer, _ = _pull(handoff, receiver)
        assert transfer.state is TransferState.DONE, transfer.error
        assert torch.equal(transfer.kv, fixed_build())
        again, _ = _pull(handoff, receiver)  # an offer is sent once
        assert again.state is TransferState.FAILED and "NOT_FOUND" in again.error
    finally:
        receiver.close()
        proc.kill()


def test_sender_killed_mid_transfer_fails_the_pull_in_time() -> None:
    proc, handoff = _sender_process("--die-in-send")
    receiver = KvReceiver(CONFIG, grpc.insecure_channel, torch.device("cpu"))
    try:
        transfer, seconds = _pull(handoff, receiver)
        assert transfer.state is TransferState.FAILED and transfer.kv is None
        assert seconds < CONFIG.timeout_s + 2
        assert proc.wait(10) == 3  # it died in the send
    finally:
        receiver.close()
        proc.kill()


@pytest.fixture(params=[30.0])
def local_sender(request):
    sender = KvSender(SenderConfig(CONFIG, max_bytes=1 << 20, ttl_s=request.param), torch.device("cpu"))
    spec = service_spec(sender, workers_pb2_grpc.add_KvTransferServicer_to_server, "pdllm.v1.KvTransfer")
    server = build_server(ServerConfig(role="prefill"), [spec]).start()
    yield sender, server.address
    sender.close()
    server.stop()


def _offer(sender: KvSender, address: str, kv: torch.Tensor) -> wpb.KvHandoff:
    handoff = sender.offer(kv, wpb.KvHandoff(payload="decode-kv"))
    assert handoff is not None
    handoff.sender = address
    return handoff


def test_receiver_gone_mid_transfer_leaves_the_sender_serving(local_sender) -> None:
    sender, address = local_sender
    kv = torch.randn(2, 2, 2, 300, 16)
    gone = _offer(sender, address, kv)
    peer = subprocess.run(
        [*PEER, "pull-and-vanish", address, base64.b64encode(gone.SerializeToString()).decode()]
    )
    assert peer.returncode == 0
    assert sender.held_bytes == 0  # the offer left with its send
    deadline = time.monotonic() + CONFIG.timeout_s + 5
    while sender.outcomes.labels("failed")._value.get() < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sender.outcomes.labels("failed")._value.get() == 1  # the send noticed, within its timeout
    receiver = KvReceiver(CONFIG, grpc.insecure_channel, torch.device("cpu"))
    try:
        transfer, _ = _pull(_offer(sender, address, kv), receiver)  # and the next receiver is served
        assert transfer.state is TransferState.DONE and torch.equal(transfer.kv, kv)
    finally:
        receiver.close()


@pytest.mark.parametrize("local_sender", [0.5], indirect=True)
def test_offers_expire_and_the_budget_declines(local_sender) -> None:
    sender, address = local_sender
    assert sender.offer(torch.zeros(1 << 19), wpb.KvHandoff()) is None  # 2 MB > the 1 MB budget
    assert sender.outcomes.labels("declined")._value.get() == 1
    handoff = _offer(sender, address, torch.zeros(1, 2, 1, 10, 8))
    time.sleep(0.6)
    receiver = KvReceiver(CONFIG, grpc.insecure_channel, torch.device("cpu"))
    try:
        transfer, _ = _pull(handoff, receiver)
        assert transfer.state is TransferState.FAILED and "NOT_FOUND" in transfer.error
        assert sender.held_bytes == 0 and sender.outcomes.labels("expired")._value.get() == 1
    finally:
        receiver.close()


def test_cuda_ipc_of_kv_not_on_a_gpu_is_refused_and_the_offer_freed(local_sender) -> None:
    sender, address = local_sender
    handoff = _offer(sender, address, torch.zeros(1, 2, 1, 10, 8))
    stub = workers_pb2_grpc.KvTransferStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as err:
        stub.Send(wpb.KvSendRequest(transfer_id=handoff.transfer_id, cuda_ipc=True), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert sender.held_bytes == 0
