"""The status codes the server interceptor logs ("rpc finished" lines), captured with a handler of their
own on the ``pdllm.rpc`` logger: pytest's caplog sees nothing once a test has run
``configure_json_logging``, which stops the ``pdllm`` tree from propagating to the root logger."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Codes(logging.Handler):
    def __init__(self, method_suffix: str) -> None:
        super().__init__(logging.INFO)
        self.suffix = method_suffix
        self.codes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "rpc finished" and str(getattr(record, "method", "")).endswith(self.suffix):
            self.codes.append(record.code)  # type: ignore[attr-defined]


@contextmanager
def finished_codes(method_suffix: str) -> Iterator[list[str]]:
    """The codes of the calls to methods ending in ``method_suffix`` that finish while inside (the list
    keeps filling after the block: a call may finish a moment after its client saw the status)."""
    handler = _Codes(method_suffix)
    logger = logging.getLogger("pdllm.rpc")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.codes
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
