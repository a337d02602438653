"""``pdllm eval``'s decodes, several at a time: each prepared alone, all denoised in the same rounds.

A method's decodes are prepared one by one in the order given (tokenize; pdllm: prefill, score, select,
build), so the chunk store sees the same requests in the same order as one decode at a time would, then
denoised together through one :class:`~pdllm.decode_service.local.LocalDecoder`: every round is one
forward for all of them. Each result keeps its own steps, unmask schedule and policy counters, and the
rounds are token-equal to decoding each alone, so what ``eval`` reports does not depend on the batch size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdllm.decode_service.local import LocalDecodeError, LocalJob
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.app.engine import PrefillingEngine, PreparedDecode, decode_prepared
from pdllm.shared.app.eval_settings import AnySample, EvalSettings
from pdllm.shared.app.trace import response
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.report import METHODS
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.loader import LoadedModel
from pdllm.shared.prompt import encode_prompt


@dataclass(frozen=True)
class Item:
    """One decode: a sample, its generation settings and decode policy; ``label`` names it in an error."""

    sample: AnySample
    gen: GenerationConfig
    policy: DecodePolicyConfig
    label: str = ""


@dataclass
class Decoded:
    """A decode's result (all its slots, its own steps) and, when traced, its response as ``generate``
    gives it."""

    result: GenerationResult
    response: pb.GenerateResponse | None = None


@dataclass
class _Prepared:
    ids: Any  # the encoded prompt
    job: LocalJob
    seconds: float  # the preparation's wall time, part of the response's total
    pdllm: PreparedDecode | None = None  # its selection and trace (pdllm)


class BatchDecoder:
    """``method``'s decodes on ``loaded``; ``traced``: each :class:`Decoded` carries its response.
    ``worker``: whose :class:`~pdllm.decode_service.local.LocalDecoder` runs the rounds (default: a new
    one, its defaults the engine's) and which makes vanilla's requests."""

    def __init__(
        self,
        loaded: LoadedModel,
        method: str,
        settings: EvalSettings,
        train_length: int,
        traced: bool = False,
        worker: DecodeWorker | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (expected one of {', '.join(METHODS)})")
        self.loaded, self.method, self.settings, self.train_length = loaded, method, settings, train_length
        self.traced = traced
        self.worker = worker or DecodeWorker(loaded.model)
        self.engines: dict[EngineConfig, PrefillingEngine] = {}

    def decode(self, items: Sequence[Item]) -> list[Decoded]:
        """``items`` prepared in order, then denoised together; results in the order of ``items``. A
        failed decode raises naming its item, once all of them have ended."""
        prepared = [self._prepare(item) for item in items]
        local = self.worker.local
        try:
            if self.method == "pdllm":  # their traces filled as the engine's own decode fills them
                results = decode_prepared(local, [p.pdllm for p in prepared if p.pdllm is not None])
            else:
                results = local.run_many([p.job for p in prepared])
        except LocalDecodeError as exc:
            first = min(exc.errors)
            names = ", ".join(items[i].label or f"#{i}" for i in sorted(exc.errors))
            raise RuntimeError(
                f"{self.method} decode of {items[first].label or f'#{first}'} failed (failed: {names}): "
                f"{exc.errors[first]!r}"
            ) from exc.errors[first]
        return [self._finish(p, r) for p, r in zip(prepared, results, strict=True)]

    def _prepare(self, item: Item) -> _Prepared:
        tok, gen, policy = self.loaded.tokenizer, item.gen, item.policy
        started = time.perf_counter()
        ids = encode_prompt(tok, item.sample.context, item.sample.question)
        if self.method == "vanilla":
            prompt = list(ids.vanilla(self.loaded.config.bos_token_id))
            job = self.worker.vanilla_job(prompt, gen, policy)
            return _Prepared(ids, job, time.perf_counter() - started)
        cfg = self.settings.engine_config(self.loaded, self.train_length, len(ids.query), gen.gen_length)
        if cfg not in self.engines:
            self.engines[cfg] = PrefillingEngine(self.loaded.model, tok, cfg)
        ready = self.engines[cfg].prepare(ids.context, ids.query, gen, ids.instruction or None, policy)
        return _Prepared(ids, ready.job, time.perf_counter() - started, ready)

    def _finish(self, p: _Prepared, result: GenerationResult) -> Decoded:
        sel = None if p.pdllm is None else p.pdllm.sel
        if not self.traced:
            return Decoded(result)
        loaded, ids = self.loaded, p.ids
        text = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
        n = len(ids.instruction) + len(ids.context) + len(ids.query)
        eos, total = loaded.config.eos_token_id, p.seconds + result.decode_seconds
        out = response(self.method, loaded.path.name, text, result, n, len(ids.context), eos, total, sel)
        return Decoded(result, out)
