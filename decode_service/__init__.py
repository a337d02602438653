"""Decode workers: steps 6-7 (static KV build, masked denoising) and the Decode server.

Modules: ``worker`` (:class:`DecodeWorker`: chunk-only KV loading, the build, one request's decode),
``build`` (static decode KV in the full-mask / chunk-query / chunk-only modes, top-B retention),
``decode`` (the DecodePolicy protocol and the single-request decode loop over the shared sampler),
``attention`` (segmented split + LSE merge, contiguous buffer + SDPA, Triton split-S over pages),
``graphs`` (CUDA-graph replay of a single-request decode step), ``kv_pool`` (the paged static KV of the
active requests), ``rounds`` (one batched forward per round over every active request), ``round_graphs``
(CUDA graphs of a round, per padded shape bucket), ``scheduler`` (admission, builds, rounds),
``server`` (``pdllm.v1.Decode``).
"""
