"""KV handoff from prefill to decode workers: torch.distributed pair groups, sender, receiver, payloads."""

from pdllm.shared.kv_transfer.pairs import TransferConfig
from pdllm.shared.kv_transfer.receiver import KvReceiver, Transfer, TransferState
from pdllm.shared.kv_transfer.sender import KvSender, SenderConfig

__all__ = ["KvReceiver", "KvSender", "SenderConfig", "Transfer", "TransferConfig", "TransferState"]
