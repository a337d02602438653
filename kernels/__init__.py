"""Triton kernels, each with its launcher and a pure-torch reference.

- :mod:`.split_s_attention` (+ :mod:`.split_s_reference`): split-S decode attention over a paged chunk-KV
  pool plus the request's local KV; ``split_s_attention`` (Triton, CUDA) and ``split_s_attention_reference``
  (torch, any device) share one signature.
- :mod:`.paged_kv`: ``PagedKVPool``, the page pool those kernels read (chunk writes, page tables).
- :mod:`.chunk_prefill_attention`: block-diagonal varlen attention for chunked prefill / scoring (+ LSE);
  no Triton (flash varlen / batched SDPA dispatch). Opt-in on the chunk prefill: ``kernel="varlen"``.
- :mod:`.retention_scores`: top-B token-retention scores from the prefill's LSE (Triton + reference).
  Opt-in on the decode build: ``build_static(..., retention="triton")``. Both against today's paths:
  ``benchmarks/prefill_kernels.py``.
- :mod:`.rms_norm`: RMSNorm, optionally fused with the residual add before it (Triton + reference).
- :mod:`.rope`: RoPE of q and k in one launch from strided views (Triton + reference).
- :mod:`.silu_mul`: SwiGLU ``silu(gate) * up``, separate or from one fused ``gate_up`` (Triton + reference).

Measured behaviour and the backend choice are in ``benchmarks/results/attention_notes.md``.
"""

import importlib.util

# Whether the Triton kernels can run at all here (each kernel module still imports triton lazily).
HAS_TRITON = importlib.util.find_spec("triton") is not None
