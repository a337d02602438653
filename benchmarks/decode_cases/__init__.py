"""The cases of ``benchmarks/decode_engine.py``, one module per theme: ``bench`` (the shared plumbing),
``loop`` (loop, compute-skip, polestar), ``rounds`` (rounds, rounds-e2e, --profile), ``mixed``,
``focus_batched``, ``polestar_tpf``, ``serve`` and ``report`` (JSON + markdown)."""
