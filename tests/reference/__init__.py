"""The reference loops: one request at a time, plainly, the specification the decode engine is tested against.

The decode worker, the in-process engine, ``generate`` and ``eval`` decode every request in the batched
rounds (``decode_service/scheduler.py``, ``rounds.py`` and the policies' ``*_rounds.py``); the loops here
are what those rounds must equal token for token (and counter for counter). They build on the runtime's
own pieces (the sampler, the policies' plans and selections, the block cache), so they are no independent
oracles (``tests/oracles/`` holds those); no runtime module imports them.

- ``vanilla.py``: ``generate_vanilla``, vanilla generation under a decode policy (or SDAR's block diffusion);
- ``static_kv.py``: pdllm's step 7 over the static chunk KV, plain or under a decode policy (its buffered and
  split-S attentions: ``static_attention.py``);
- ``sdar.py``: pdllm's step 7 on SDAR models, block diffusion continuing the block-causal prefix;
- ``policy.py``: the cache policies' loop (``PolicyLogits`` under the shared sampler) and the local rows;
- ``compute_skip.py``: DyLLM's and FOCUS's loops behind one entry point (``dyllm.py``, ``focus.py``,
  ``focus_layers.py``);
- ``block_diffusion.py``: block diffusion, one denoising step at a time over the exact cache.
"""
