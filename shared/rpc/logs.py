"""Structured JSON-lines logging with the current request id attached to every record.

The request id lives in a ContextVar, so it follows the handler thread of a sync gRPC call (and any
code it calls) without being passed around; the server interceptor binds it for the life of each call.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Iterator
from typing import IO

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdllm_request_id", default=None)

# Attributes every LogRecord has; anything else was passed through `extra=` and is emitted as a field.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def current_request_id() -> str | None:
    """The request id of the RPC running on this thread (assigned by the server if the client sent none)."""
    return REQUEST_ID.get()


@contextlib.contextmanager
def bind_request_id(request_id: str | None) -> Iterator[None]:
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id (when bound), extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key != "request_id" and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_json_logging(level: int | str = logging.INFO, stream: IO[str] | None = None) -> logging.Handler:
    """Route the `pdllm` logger tree to JSON lines on `stream` (stderr by default); returns the handler."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("pdllm")
    logger.handlers = [h for h in logger.handlers if not isinstance(h.formatter, JsonFormatter)]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler
