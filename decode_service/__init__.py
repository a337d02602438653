"""Decode workers: steps 6-7 (static KV build, masked denoising) and the Decode server.

A request's path: ``server`` (``pdllm.v1.Decode``) -> ``request`` (:class:`DecodeRequest`, its status) ->
``scheduler`` (admission, KV pulls, builds, one iteration at a time) -> ``sessions`` (what a request
becomes) -> ``rounds`` / ``round_graphs`` (one batched forward per round over every session in the rounds,
graphed per padded shape bucket; ``policy_rounds`` and ``polestar_rounds``: caching policies in them;
``dyllm_rounds`` over ``layer_edits``: DyLLM, its cached activations edited inside each layer;
``block_rounds``: SDAR, ``sdar_focus_rounds`` over ``split_rounds``: SDAR under FOCUS, its rows changing
after layer 1) -> the sampler.

Beside it: ``worker`` (:class:`DecodeWorker`: chunk-only KV loading, the build, the in-process decode),
``local`` (the scheduler driven from the caller's thread: ``generate``, ``eval``), ``build`` (static decode
KV, top-B retention), ``kv_pool`` (the active requests' paged KV), ``handoff`` (a prefill worker's KV pulled
into the pool), ``policies`` (the decode policies), ``block_diffusion`` / ``sdar_decode`` (SDAR),
``attention`` (the build's segmented attention over the static KV). The one-request reference loops the
tests hold the rounds to are ``tests/reference/``'s.
"""
