"""The reference loop's other attentions over the static KV (``static_kv.StaticPolicy``'s "buffer" and
"triton"), beside ``decode_service/attention.py``'s segmented one:

- :class:`BufferedAttention`, for a static prefix that one build forward produced contiguously: the local
  K/V are written into the tail of a preallocated buffer and one SDPA call (FlashAttention on CUDA) covers
  both; no per-step concatenation either;
- :class:`PagedSplitSAttention`, the kernels' split-S kernel over the static KV laid out once as pages.
"""

from __future__ import annotations

import torch

from pdllm.shared.model.attention import sdpa


class BufferedAttention:
    """Static KV ``[layers, 2, Hkv, S, D]`` copied once into a buffer with room for ``local`` tokens."""

    def __init__(self, static: torch.Tensor, local: int) -> None:
        layers, _, hkv, s, d = static.shape
        self.static_len = s
        self.buffer = torch.empty(layers, 2, 1, hkv, s + local, d, dtype=static.dtype, device=static.device)
        self.buffer[:, :, 0, :, :s] = static

    def load(self, static: torch.Tensor) -> None:
        """Replace the static KV in place (same shape), keeping the buffer's address for graph replay."""
        if static.shape[3] != self.static_len:
            raise ValueError(f"static KV has {static.shape[3]} tokens, the buffer holds {self.static_len}")
        self.buffer[:, :, 0, :, : self.static_len] = static

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.static_len + k.shape[2]
        self.buffer[layer, 0, :, :, self.static_len : end] = k
        self.buffer[layer, 1, :, :, self.static_len : end] = v
        return sdpa(q, self.buffer[layer, 0, :, :, :end], self.buffer[layer, 1, :, :, :end])


class PagedSplitSAttention:
    """The kernels helper's Triton split-S kernel over the static KV laid out once as pages.

    The static prefix is copied once into ``page_size`` pages (one request, pages in order); every layer
    call then reads it straight from the pages plus the step's local K/V, with all sizes fixed on the host
    so the call can be captured in a CUDA graph.
    """

    def __init__(self, static: torch.Tensor, page_size: int = 64) -> None:
        from pdllm.kernels.split_s_attention import split_s_attention

        self._kernel = split_s_attention
        layers, _, hkv, s, d = static.shape
        pages = max(1, -(-s // page_size))
        self.page_size = page_size
        self.pages = torch.zeros(
            layers, 2, pages, hkv, page_size, d, dtype=static.dtype, device=static.device
        )
        self.static_len = s
        self.load(static)
        device = static.device
        self.page_table = torch.arange(pages, dtype=torch.int32, device=device)[None]
        self.kv_lens = torch.tensor([s], dtype=torch.int32, device=device)
        self._offsets: dict[int, torch.Tensor] = {}

    def load(self, static: torch.Tensor) -> None:
        """Write ``static`` into the pages in place (same token count)."""
        layers, _, hkv, s, d = static.shape
        if s != self.static_len:
            raise ValueError(f"static KV has {s} tokens, the pages hold {self.static_len}")
        pages = self.pages.shape[2]
        padded = torch.zeros(
            layers, 2, hkv, pages * self.page_size, d, dtype=static.dtype, device=static.device
        )
        padded[:, :, :, :s] = static
        self.pages.copy_(padded.view(layers, 2, hkv, pages, self.page_size, d).permute(0, 1, 3, 2, 4, 5))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        offsets = self._offsets.get(t)
        if offsets is None:
            offsets = torch.tensor([0, t], dtype=torch.int32, device=q.device)
            self._offsets[t] = offsets
        out = self._kernel(
            q[0].transpose(0, 1),
            self.pages[layer, 0],
            self.pages[layer, 1],
            self.page_table,
            self.kv_lens,
            offsets,
            k_local=k[0].transpose(0, 1),  # strided views: the kernel takes row strides, no copy
            v_local=v[0].transpose(0, 1),
            max_q_len=t,
            max_kv_len=self.static_len,
        )
        return out.transpose(0, 1)[None]
