"""The router: public ``pdllm.v1.Generation`` front door over prefill and decode workers.

Per request: validate and fill defaults, tokenize (instruction, context and question separately), send
the prefill to a worker (document affinity, else least outstanding tokens), then stream the decode from
the least loaded decode worker, relaying partial outputs (``GenerateStream`` only: unary ``Generate`` asks
the decode worker for none) and assembling the final trace. Deadlines are passed down as the time the
client has left; a client that goes away cancels the worker calls (past its deadline they end on that
deadline by themselves, so every server records DEADLINE_EXCEEDED).

Retries (``retries.py``): each phase gets up to ``RouterConfig.attempts`` tries, each on a worker not tried
yet for this request, under the same request id (workers treat request ids idempotently).

- UNAVAILABLE (the worker is gone or draining, or a decode worker died mid-stream): the worker is reported
  to its pool as failed and the phase is retried elsewhere. A decode retry after partial outputs were
  relayed restarts the answer on the new worker; the client only sees the new worker's partials once they
  unmask more than it was already shown, so its stream stays monotone.
- RESOURCE_EXHAUSTED (the worker is up but full: its admission limit, decode queue or KV pool refused the
  request): the phase is retried elsewhere but the worker is *not* reported (busy is not dead). Decode
  retries only if that worker sent nothing yet (workers refuse at admission, before any output); one
  arriving mid-stream is passed to the client as is.

When the tries run out (or no untried worker is left) the client gets RESOURCE_EXHAUSTED if any worker
was busy ("retry later"), else the last error (UNAVAILABLE when none was reachable); any other worker
status is passed on at once without a retry.

These loops are hand-written rather than gRPC's retry policy (service config): a policy retries on the same
channel, i.e. the same worker, while each retry here must go to another worker, and only before any
output was relayed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import generation_pb2_grpc, workers_pb2_grpc
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.convert import decode_policy_params, generation_params, method_params
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.rpc.logs import bind_request_id, current_request_id
from pdllm.shared.rpc.validation import (
    RequestDefaults,
    ResolvedRequest,
    ValidationLimits,
    new_request_id,
    resolve_generate_request,
)

from .retries import BUSY, RETRYABLE, Tries, as_error
from .routing import LoadTracker, build_on_prefill, document_key
from .trace import request_trace

_log = logging.getLogger("pdllm.router")


@dataclass(frozen=True)
class RouterConfig:
    max_queue: int = 256  # requests admitted at once; beyond: RESOURCE_EXHAUSTED
    attempts: int = 3  # tries per phase (another worker each time) on UNAVAILABLE / RESOURCE_EXHAUSTED
    default_timeout_s: float = 600.0  # when the client sets no deadline
    model_name: str = ""
    # Traces name the workers by the address the router used; False (all-in-one: private loopback
    # workers) leaves the names empty, as generation.proto says.
    name_workers: bool = True
    # Where the decode KV of a pdllm request is built: "decode", "prefill" (handed off), "auto" (routing.py).
    build_on: str = "decode"


class Pools:
    """The router's view of its workers: healthy addresses and a channel per address, per role."""

    def __init__(self, healthy: Callable[[str], tuple[str, ...]], channel: Callable[[str], grpc.Channel]):
        self.healthy = healthy
        self.channel = channel
        self._failed: Callable[[str, str], None] = lambda role, address: None

    def on_failure(self, callback: Callable[[str, str], None]) -> None:
        self._failed = callback

    def report_failure(self, role: str, address: str) -> None:
        self._failed(role, address)


class RouterServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: Any,
        pools: Pools,
        config: RouterConfig | None = None,
        limits: ValidationLimits | None = None,
        defaults: RequestDefaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pools = pools
        self.config = config or RouterConfig()
        self.limits = limits
        self.defaults = defaults
        self.prefill_load = LoadTracker()
        self.decode_load = LoadTracker()
        self._admitted = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public API
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        final = None
        for event in self._run(request, context, stream=False):
            if event.HasField("final"):
                final = event.final
        assert final is not None  # _run either yields a final message or raises
        return final

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        yield from self._run(request, context, stream=True)

    # ------------------------------------------------------------------ one request
    def _run(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext, stream: bool
    ) -> Iterator[pb.GenerateStreamResponse]:
        """One request's events; ``stream`` asks the decode worker for partial outputs (GenerateStream)."""
        started = time.perf_counter()
        resolved = resolve_generate_request(request, self.limits, self.defaults)
        # The server interceptor already bound an id for a request that has none (its log lines carry it).
        rid = resolved.request_id or current_request_id() or new_request_id()
        with bind_request_id(rid), self._admission(rid):
            ids = encode_prompt(self.tokenizer, resolved.context, resolved.question, resolved.instruction)
            gen, method = generation_params(resolved), method_params(resolved)
            deadline = time.monotonic() + self._budget(context)
            prefill: wpb.PrefillResponse | None = None
            prefill_at = ""  # the address of the prefill worker that answered
            if resolved.method == "pdllm":
                prefill, prefill_at = self._prefill(rid, ids, gen, method, deadline, context)
            decode_req = wpb.DecodeRequest(
                request_id=rid,
                instruction_ids=ids.instruction,
                question_ids=ids.query,
                generation=gen,
                method=method,
                stream_partials=stream,
                decode_policy=decode_policy_params(resolved),
            )
            if prefill is None:
                decode_req.context_ids.extend(ids.context)
            else:
                decode_req.kv_spec.CopyFrom(prefill.kv_spec)
                decode_req.chunks.extend(prefill.selected)
                if prefill.HasField("handoff"):
                    decode_req.handoff.CopyFrom(prefill.handoff)
            ttft: float | None = None
            shown = 0  # unmasked slots in the last partial relayed
            for decode_at, event in self._decode(decode_req, deadline, context):
                if event.HasField("partial"):
                    # generation.proto: unmasked slots never go back to masked. After a retry on another
                    # worker its stream starts over; relay its partials only once they pass what was shown.
                    if event.partial.unmasked <= shown:
                        continue
                    shown = event.partial.unmasked
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    yield pb.GenerateStreamResponse(partial=self._partial(rid, event.partial))
                else:
                    workers = (prefill_at, decode_at) if self.config.name_workers else ("", "")
                    final = self._final(rid, resolved, ids, prefill, event.final, workers, started, ttft)
                    yield pb.GenerateStreamResponse(final=final)
                    return
            raise PdllmError(
                "decode worker ended the stream without a result", code=grpc.StatusCode.UNAVAILABLE
            )

    @contextmanager
    def _admission(self, rid: str) -> Iterator[None]:
        with self._lock:
            if self._admitted >= self.config.max_queue:
                raise PdllmError(
                    f"router queue is full ({self.config.max_queue} requests); retry later",
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    request_id=rid,
                )
            self._admitted += 1
        try:
            yield
        finally:
            with self._lock:
                self._admitted -= 1

    def _prefill(self, rid, ids, gen, method, deadline, context) -> tuple[wpb.PrefillResponse, str]:
        """The prefill worker's response and its address."""
        req = wpb.PrefillRequest(
            request_id=rid,
            instruction_ids=ids.instruction,
            context_ids=ids.context,
            question_ids=ids.query,
            method=method,
            generation=gen,
        )
        doc = document_key(ids.context)
        tokens = len(ids.context) + len(ids.query)

        def call(address: str) -> tuple[wpb.PrefillResponse, str]:
            stub = workers_pb2_grpc.PrefillStub(self.pools.channel(address))
            decoding = min((self.decode_load.load(a) for a in self.pools.healthy("decode")), default=0)
            req.offer_handoff = build_on_prefill(
                self.config.build_on, self.prefill_load.load(address), decoding
            )
            with self.prefill_load.outstanding(address, tokens):
                future = stub.Prefill.future(req, timeout=self._remaining(deadline))
                _cancel_when_client_leaves(context, future.cancel)
                try:
                    response = future.result()
                except grpc.FutureCancelledError:  # our caller left (cancelled, or its deadline passed)
                    raise PdllmError(
                        "the client went away during prefill", code=grpc.StatusCode.CANCELLED
                    ) from None
            self.prefill_load.remember(doc, address)
            if response.HasField("handoff"):  # decode workers pull from the address we reached it at
                response.handoff.sender = address
            return response, address

        return self._with_retries("prefill", self.prefill_load, call, doc, tokens)

    def _decode(
        self, req: wpb.DecodeRequest, deadline: float, context
    ) -> Iterator[tuple[str, wpb.DecodeResponse]]:
        """The decode stream's events, each with the address of the worker that sent it."""
        tries = Tries("decode")
        for _ in range(self.config.attempts):
            address = self._choose("decode", self.decode_load, tries)
            stub = workers_pb2_grpc.DecodeStub(self.pools.channel(address))
            stream = stub.Decode(req, timeout=self._remaining(deadline))
            _cancel_when_client_leaves(context, stream.cancel)
            sent = False
            try:
                with self.decode_load.outstanding(address, 1):
                    for event in stream:
                        sent = True
                        if event.HasField("final"):
                            # Read the stream to its end before answering: cancelling it now (the
                            # `finally` below) would end the worker's successful call as CANCELLED.
                            with contextlib.suppress(grpc.RpcError):  # the answer is in hand already
                                for _ in stream:
                                    pass
                            yield address, event
                            return
                        yield address, event
                return
            except grpc.RpcError as err:
                if err.code() == BUSY and sent:  # not an admission refusal: do not redo relayed work
                    raise as_error(err, "decode") from err
                self._failed(tries, address, err)
            finally:
                stream.cancel()
        raise tries.give_up()

    def _with_retries(self, role: str, tracker: LoadTracker, call, doc: str | None, tokens: int = 0):
        tries = Tries(role)
        for _ in range(self.config.attempts):
            address = self._choose(role, tracker, tries, doc, tokens)
            try:
                return call(address)
            except grpc.RpcError as err:
                self._failed(tries, address, err)
        raise tries.give_up()

    def _failed(self, tries: Tries, address: str, err: grpc.RpcError) -> None:
        """Record a failed try; raise at once unless the status is retryable. Busy workers stay healthy."""
        if err.code() not in RETRYABLE:
            raise as_error(err, tries.role) from err
        tries.record(address, err)
        if err.code() == BUSY:
            _log.warning(f"{tries.role} worker busy; retrying elsewhere", extra={"worker": address})
        else:
            self.pools.report_failure(tries.role, address)
            _log.warning(f"{tries.role} worker unavailable; retrying", extra={"worker": address})

    def _choose(
        self, role: str, tracker: LoadTracker, tries: Tries, doc: str | None = None, tokens: int = 0
    ) -> str:
        try:
            return tracker.choose(self.pools.healthy(role), doc, exclude=tries.tried, tokens=tokens)
        except LookupError:
            if tries.tried:  # every worker was tried: report why they failed
                raise tries.give_up() from None
            raise PdllmError(
                f"no healthy {role} worker is available", code=grpc.StatusCode.UNAVAILABLE
            ) from None

    def _budget(self, context: grpc.ServicerContext) -> float:
        """Seconds the client gave us (grpc reports "no deadline" as a huge number or None)."""
        left = context.time_remaining()
        if left is None or left > self.config.default_timeout_s:
            return self.config.default_timeout_s
        return left

    @staticmethod
    def _remaining(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PdllmError(
                "deadline exceeded before the request finished", code=grpc.StatusCode.DEADLINE_EXCEEDED
            )
        return left

    # ------------------------------------------------------------------ messages
    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _partial(self, rid: str, p: wpb.PartialOutput) -> pb.PartialOutput:
        out = pb.PartialOutput()
        out.CopyFrom(p)
        out.request_id = rid
        prefix = []
        for t in p.token_ids:
            if t < 0 or t == self.tokenizer.eos_token_id:
                break
            prefix.append(t)
        out.text = self._text(prefix)
        return out

    def _final(
        self, rid, resolved: ResolvedRequest, ids, prefill, result: wpb.DecodeResult, workers, started, ttft
    ):
        """The client's response. ``ttft`` is the time to the first relayed partial output; with none (unary
        Generate asks for none, or the worker sent none) it is the time to this final result, equal to
        ``total_s``."""
        trace = request_trace(resolved, ids, prefill, result, workers)
        timings = trace.timings
        total = time.perf_counter() - started
        timings.ttft_s = ttft if ttft is not None else total
        timings.total_s = total
        return pb.GenerateResponse(
            request_id=rid,
            model=resolved.model,
            text=self._text(list(result.token_ids)).strip(),
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            trace=trace,
        )


def _cancel_when_client_leaves(context: grpc.ServicerContext, cancel: Callable[[], object]) -> None:
    """Cancel a worker call once the client's call ends early, except when the client's deadline ended
    it: the worker call carries that deadline (the time left when it was sent) and ends by itself at
    once, so the worker records DEADLINE_EXCEEDED like the router, not CANCELLED."""

    def ended() -> None:
        left = context.time_remaining()
        if left is None or left > 0:
            cancel()

    context.add_callback(ended)
