"""Scoring's room in the chunk bank: ``score_tail`` leaves enough free slots after each row for the longest
local block a scoring forward writes there, and makes a row's keys a multiple of ``KEY_MULTIPLE``, so
:class:`BankPrefixAttention` attends in place (no concatenated copy) in the draft and the NLL forwards."""

from __future__ import annotations

import torch

from pdllm.prefill_service.attention import KEY_MULTIPLE, BankPrefixAttention
from pdllm.prefill_service.scoring import score_tail
from pdllm.shared.chunk_prefill import ChunkBank
from pdllm.shared.config import EngineConfig
from pdllm.shared.layout import Request


def test_tail_fits_the_nll_block_and_aligns_the_row() -> None:
    for mode, labels in (("pseudo-label", 4), ("self-info", 0), ("query-only", 0)):
        config = EngineConfig(chunk_size=64, top_k=2, score_mode=mode)
        window = config.scoring_window()
        for q in (1, 7, 24, 31):
            scored = min(q, window) if window else q  # query-only scores the query's last tokens
            for width in (33, 64, 65, 1025):
                request = Request(instruction=[], chunks=[[1] * width], query=list(range(q)))
                tail = score_tail(request, config, width)
                assert (width + tail) % KEY_MULTIPLE == 0
                assert 1 + scored + labels <= tail < 1 + scored + labels + KEY_MULTIPLE


def test_attention_takes_the_bank_in_place_for_both_scoring_blocks() -> None:
    width, q, labels = 65, 10, 4
    config = EngineConfig(chunk_size=64, top_k=2)
    tail = score_tail(Request([], [[1] * width], list(range(q))), config, width)
    bank = ChunkBank(kv=torch.zeros(1, 2, 3, 1, width + tail, 8), lens=[width, width, 40])
    valid = torch.arange(width)[None] < torch.tensor(bank.lens)[:, None]
    attention = BankPrefixAttention(bank, slice(0, 3), valid, local_causal=True)
    for t in (q + labels, 1 + q + labels):  # the draft's block, then the NLL forward's
        assert attention.keys(t) == width + tail
    no_room = ChunkBank(kv=torch.zeros(1, 2, 3, 1, width, 8), lens=bank.lens)
    fallback = BankPrefixAttention(no_room, slice(0, 3), valid, local_causal=True)
    assert fallback.keys(q + labels) % KEY_MULTIPLE == 0 and fallback.keys(q + labels) >= width + q + labels
