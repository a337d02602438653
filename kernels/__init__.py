"""Triton kernels, each with its launcher and a pure-torch reference.

- :mod:`.split_s_attention` (+ :mod:`.split_s_reference`): split-S decode attention over a paged chunk-KV
  pool plus the request's local KV; ``split_s_attention`` (Triton, CUDA) and ``split_s_attention_reference``
  (torch, any device) share one signature. Their device functions (a key block's softmax step, paged row
  offsets, a program's row store, the split merge) live in :mod:`.split_s_blocks`, shared with the
  experimental Hopper kernels :mod:`.split_s_hopper` (``PDLLM_SPLIT_S=hopper``).
- :mod:`.paged_kv`: ``PagedKVPool``, the page pool those kernels read (chunk writes, page tables).
- :mod:`.ragged_attention`: the decode path's one attention call over a ragged batch of packed rows: decode
  entries over their page lists through split-S (:mod:`.gathered_attention` off the GPU), chunk-prefill
  pieces through :mod:`.chunk_prefill_attention`, one packed output.
- :mod:`.chunk_prefill_attention`: block-diagonal varlen attention for chunked prefill / scoring (+ LSE);
  no Triton (flash varlen / batched SDPA dispatch). The decode worker uses it (``kernel="varlen"``) to
  recompute bidirectional chunks on CUDA; the prefill worker keeps padded SDPA (faster at its shapes).
- :mod:`.retention_scores`: top-B token-retention scores from the prefill's LSE (Triton + reference).
  The decode worker sums bidirectional top-B scores with it on CUDA (``retention="triton"``). Both choices
  measured in ``benchmarks/results/prefill_kernels.md``.
- :mod:`.salient_attention`: DyLLM's approximate context update, ``A_t ΔV`` summed over the salient columns
  only (Triton + reference); the DyLLM rounds run the kernel under Triton round attention, else the reference.
- :mod:`.rms_norm`: RMSNorm, optionally fused with the residual add before it (Triton + reference).
- :mod:`.rope`: RoPE of q and k in one launch from strided views (Triton + reference).
- :mod:`.silu_mul`: SwiGLU ``silu(gate) * up``, separate or from one fused ``gate_up`` (Triton + reference).
- :mod:`.skinny_gemm`: GEMMs of at most 64 rows (a decode step) with SwiGLU or the residual add in the
  epilogue; the model's MLP takes them on CUDA where :func:`~.skinny_gemm.pick_config` has a config.
- :mod:`.resources`: the device's shared-memory limit and the launch guard. Each launcher fits its config to
  that limit per dtype (pure ``fit_config`` / ``pick_config`` functions, tested on CPU) and falls back to its
  reference, logged once, where nothing fits or Triton refuses the launch for lack of resources.

Measured behaviour and the backend choice are in ``benchmarks/results/attention_notes.md``.
"""

import importlib.util

# Whether the Triton kernels can run at all here (each kernel module still imports triton lazily).
HAS_TRITON = importlib.util.find_spec("triton") is not None
