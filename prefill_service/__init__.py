"""Prefill workers: chunk prefill, chunk scoring, top-K/top-B selection, KV publication.

Modules: ``config`` (EngineConfig), ``layout`` (chunking, positions, selection helpers), ``reference``
(the explicit-mask specification of every phase), ``prefill`` (batched chunk prefill + chunk store reuse),
``scoring`` (self-information / pseudo-label scores over banked KV), ``build`` (static decode KV in the
full-mask / chunk-query / chunk-only modes, top-B retention), ``store`` (ChunkKVStore protocol, LRU),
``trace`` (per-request trace). The in-process wiring is ``pdllm.shared.engine.PrefillingEngine``.
"""
