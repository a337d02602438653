"""Independent oracles of the decode policies and of pseudo-label chunk scoring.

Each module here re-derives one policy from its paper and from the semantics its runtime docstring
documents, written directly in torch over the model's public pieces (``DiffusionLM``'s forward, its
config, its layers' norms and projections). None of them imports the policy modules, the sampler, the
prefill or decode services or any other runtime helper: a bug in a helper that a runtime fast path and its
runtime reference share shows up here as a disagreement. ``plain.py`` holds what the oracles share among
themselves (RoPE, a layer's projections, attention over an optional static prefix, the unmasking rule).
"""
