"""How the router retries a phase of a request (prefill, or decode) on another worker, and what the
client gets when it stops.

``RETRYABLE`` are the worker statuses that send a phase to another worker: UNAVAILABLE (the worker is gone,
so the router also reports it to its pool) and RESOURCE_EXHAUSTED (``BUSY``: the worker is up but full, and
stays in its pool). :class:`Tries` records the workers one phase tried and why each failed; once no try is
left, it gives the client RESOURCE_EXHAUSTED if any of them was busy, else the last error, turned into a
:class:`PdllmError` by :func:`as_error` (any other worker status is passed on at once that way).
"""

from __future__ import annotations

import grpc

from pdllm.shared.rpc.errors import PdllmError

# Worker statuses that send a phase to another worker; only UNAVAILABLE marks the worker failed.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


class Tries:
    """The workers one phase of one request has tried, and why they failed."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.tried: set[str] = set()
        self.busy: list[str] = []
        self.last: grpc.RpcError | None = None
        self.last_busy: grpc.RpcError | None = None

    def record(self, address: str, err: grpc.RpcError) -> None:
        self.tried.add(address)
        self.last = err
        if err.code() == BUSY:
            self.busy.append(address)
            self.last_busy = err

    def give_up(self) -> PdllmError:
        """The error for the client once no try is left: RESOURCE_EXHAUSTED if any worker was busy."""
        if self.last_busy is not None:
            details = self.last_busy.details() or BUSY.name
            return PdllmError(
                f"no {self.role} worker could take the request: {len(self.busy)} of {len(self.tried)} "
                f"tried were busy (last: {details}); retry later",
                code=BUSY,
            )
        return as_error(self.last, self.role)


def as_error(err: grpc.RpcError | None, role: str) -> PdllmError:
    """The client's error for a worker call that failed with ``err`` (None: no call was made): an invalid
    argument is the client's own, so it is passed on as is; any other status names the role."""
    if err is None:
        return PdllmError(f"{role} failed", code=grpc.StatusCode.UNAVAILABLE)
    code = err.code()
    details = err.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return PdllmError(details, code=code)
    return PdllmError(f"{role} worker: {details}", code=code)
