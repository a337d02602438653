"""A test double of the Generation service for exercising the RPC plumbing (not the engine).

It validates requests with the real validation module, then answers deterministically: the answer is the
question's UTF-8 bytes (mod 256) cut to gen_length, unmasked left to right over `steps` partial messages.
Special questions drive the plumbing tests: "slow" sleeps `step_delay_s` per step, "slow-abort" too and
fails with CANCELLED once the call has ended, "boom" raises an unexpected exception.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import generation_pb2_grpc as pb_grpc
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.rpc.server import ServiceSpec, service_spec, termination_event
from pdllm.shared.rpc.validation import ResolvedRequest, ValidationLimits, resolve_generate_request

MODEL = "tiny-echo"


@dataclass
class FakeGeneration(pb_grpc.GenerationServicer):
    limits: ValidationLimits = field(default_factory=lambda: ValidationLimits(models=(MODEL,)))
    step_delay_s: float = 0.05
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    completed_streams: int = 0

    def _answer(self, req: ResolvedRequest) -> list[int]:
        return [b % 256 for b in req.question.encode("utf-8")][: req.gen_length]

    def _final(self, req: ResolvedRequest, tokens: list[int]) -> pb.GenerateResponse:
        chunks = len(req.context) // req.chunk_size + 1
        selected = list(range(min(req.top_k, chunks)))
        return pb.GenerateResponse(
            request_id=req.request_id,
            model=req.model,
            text=bytes(tokens).decode("latin-1"),
            token_ids=tokens,
            finish_reason="length",
            trace=pb.Trace(
                method=req.method,
                kv_mode=req.kv_mode,
                score_mode=req.score_mode,
                num_chunks=chunks,
                selected_chunk_ids=selected,
                chunk_scores=[
                    pb.ChunkScore(chunk_id=i, total=float(i), selected=i in selected) for i in range(chunks)
                ],
                steps=req.steps,
            ),
        )

    def _run(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> ResolvedRequest:
        req = resolve_generate_request(request, self.limits)
        if req.question == "boom":
            raise RuntimeError("secret internal detail")
        return req

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        req = self._run(request, context)
        if req.question == "slow":
            self.started.set()
            terminated = termination_event(context)
            for _ in range(req.steps):
                if terminated.wait(self.step_delay_s):  # a step's work, cut short when the call ends
                    self.cancelled.set()
                    break
        return self._final(req, self._answer(req))

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        req = self._run(request, context)
        tokens = self._answer(req)
        terminated = termination_event(context)
        slow = req.question.startswith("slow")
        self.started.set()
        slots = [-1] * len(tokens)
        per_step = max(1, -(-len(tokens) // req.steps))
        completed = False
        try:
            for step in range(req.steps):
                if (slow and terminated.wait(self.step_delay_s)) or terminated.is_set():
                    if req.question == "slow-abort":  # like a router whose worker call was cancelled
                        raise PdllmError("worker call cancelled", code=grpc.StatusCode.CANCELLED)
                    return
                for i in range(step * per_step, min(len(tokens), (step + 1) * per_step)):
                    slots[i] = tokens[i]
                yield pb.GenerateStreamResponse(
                    partial=pb.PartialOutput(
                        request_id=req.request_id,
                        step=step + 1,
                        total_steps=req.steps,
                        token_ids=slots,
                        unmasked=sum(t >= 0 for t in slots),
                    )
                )
            self.completed_streams += 1
            completed = True
            yield pb.GenerateStreamResponse(final=self._final(req, tokens))
        finally:
            # grpc stops pulling from this generator once the client is gone and closes it (GeneratorExit at
            # the pending yield); either way the work ended before the final message was produced.
            if not completed:
                self.cancelled.set()


def fake_spec(servicer: FakeGeneration) -> ServiceSpec:
    full_name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    return service_spec(servicer, pb_grpc.add_GenerationServicer_to_server, full_name)
