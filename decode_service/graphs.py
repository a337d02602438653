"""CUDA-graph replay of the decode step (GPU only).

A decode step forwards the same number of tokens at the same positions over the same static KV every
step; only the response token ids change. With a step-invariant attention backend the whole forward
(embedding, all layers, LM head over every response row) is captured once and replayed, which removes the
per-kernel launch cost that otherwise dominates a ~5 ms memory-bound step. Logits are computed for all
response rows inside the graph and the masked rows picked afterwards (row-wise identical math).
"""

from __future__ import annotations

import torch

from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM


class GraphedStep:
    def __init__(
        self,
        model: DiffusionLM,
        backend: AttentionBackend,
        local: torch.Tensor,
        positions: torch.Tensor,
        query_len: int,
        warmup: int = 2,
    ) -> None:
        if local.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.local = local
        self.query_len = query_len
        rows = torch.arange(query_len, local.shape[0], device=local.device)[None]

        def step() -> torch.Tensor:
            hidden = model.hidden_states(self.local[None], positions, backend)
            return model.logits_from_hidden(hidden, rows)[0]

        stream = torch.cuda.Stream(device=local.device)
        stream.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(local.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step()

    def __call__(self, response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        self.local[self.query_len :] = response
        self.graph.replay()
        return self.logits[at]
