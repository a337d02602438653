"""The composition: the one part of ``pdllm.shared`` that imports the services and the router.

``engine`` (the in-process engine: the prefill worker's and the decode worker's phases in one process),
``serve`` (``pdllm serve``: router, prefill worker, decode worker or all three), ``cli`` (the ``pdllm``
command), ``demo`` (``pdllm demo``), ``eval`` (``pdllm eval``). Everything else in ``pdllm.shared`` is the
core both roles build on and imports neither service (``tests/test_layering.py``).
"""
