"""KV handoff from prefill to decode workers: torch.distributed pair groups, sender, payloads (the decode
worker's receiver is ``decode_service/kv_receiver.py``)."""

from pdllm.shared.kv_transfer.pairs import TransferConfig
from pdllm.shared.kv_transfer.sender import KvSender, SenderConfig

__all__ = ["KvSender", "SenderConfig", "TransferConfig"]
