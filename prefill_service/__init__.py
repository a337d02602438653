"""Prefill workers: steps 3-5 (chunk prefill, chunk scoring, top-K selection) and the Prefill server.

Modules: ``worker`` (:class:`PrefillWorker`: jobs, batched steps 3-5, the :class:`Selection` it returns),
``scoring`` (self-information / pseudo-label scores over banked KV), ``attention`` (the scoring forward's
attention over banked chunk KV), ``trace`` (per-request trace and memory meter), ``batching`` (the
cross-request queue of the server), ``server`` (``pdllm.v1.Prefill``). Chunk prefill itself, the chunk
store, the engine config and the request layout are in ``pdllm.shared`` (the decode worker uses them too).
"""
