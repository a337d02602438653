"""The plumbing every decode_engine case shares: :class:`Bench` (one run's settings, the model in use with
its forwards counted, engines, prompts, the rows and notes recorded), :class:`Policy`, :class:`CaseInfo` and the
row helpers."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids
from benchmarks.harness import ForwardCounter, Run
from benchmarks.shapes import dream7b, sdar8b, tiny, tiny_sdar
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig

if TYPE_CHECKING:
    from benchmarks.decode_cases.replay import Replay
    from benchmarks.decode_cases.rounds import Rounds

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = ("case", "policy", "method", "context_tokens", "gen_length", "batch", "tokens_per_s", "round_ms",
            "forwards_per_round", "tpf", "speedup_vs_vanilla", "speedup_vs_dual_cache", "peak_gib")  # fmt: skip
SHIPPED = ROOT / "shared" / "checkpoints" / "pdllm-needle"


@dataclass(frozen=True)
class CaseInfo:
    run: Callable[[Bench], None]
    title: str
    model: str  # which model it runs: cases of one model run together
    default: bool = True
    gpu: bool = True  # GPU shapes (without a CUDA device: the smoke sizes); False: runs anywhere


@dataclass(frozen=True)
class Policy:
    """A decode policy as a case runs it: its name and Polestar-Cache knobs."""

    name: str
    knobs: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.name

    @property
    def key(self) -> str:
        return self.label + (json.dumps(dict(self.knobs), sort_keys=True) if self.knobs else "")

    def config(self) -> DecodePolicyConfig:
        return (
            DecodePolicyConfig(self.name, polestar=dict(self.knobs))
            if self.knobs
            else DecodePolicyConfig(self.name)
        )


@dataclass
class Bench:
    """One run of the benchmark: its settings, the model in use (one at a time, its forwards counted),
    engines, prompts, and what the cases recorded."""

    args: argparse.Namespace
    run: Run
    rows: list[dict] = field(default_factory=list)
    cases: dict[str, dict] = field(default_factory=dict)
    loop_runs: dict[tuple, dict] = field(default_factory=dict)  # memo: cases share their baselines
    model_name: str | None = None
    model: Any = None
    counter: ForwardCounter | None = None
    engines: dict[str, PrefillingEngine] = field(default_factory=dict)
    shipped: Any = None  # the loaded shipped checkpoint (polestar-tpf)
    rounds: Rounds | None = None  # the rounds cases' pool and round forward, dropped after each
    full_step_s: dict[tuple[str, int], float] = field(default_factory=dict)  # loop warm-up: one full step
    overhead_s: dict[tuple[str, int], float] = field(default_factory=dict)  # pdllm prefill + build
    warmed: set[tuple] = field(default_factory=set)
    replay: Replay | None = None  # --schedule: the rounds cases' requests replay recorded unmask counts

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def block(self) -> int:
        return self.args.block

    def left(self) -> float:
        return self.run.left()

    def use(self, name: str) -> Any:
        """The model ``name`` (dream, sdar, shipped) with a forward counter installed; the previous one
        is dropped first (7B models and a KV pool do not all fit at once)."""
        if self.model_name == name:
            return self.model
        self.drop()
        t = time.perf_counter()
        if name == "shipped":
            from pdllm.shared.model.loader import load_model

            self.shipped = load_model(str(SHIPPED))  # on the CPU, fp32, wherever the run is
            self.model = self.shipped.model
        else:
            smoke = self.run.smoke
            config = {"dream": tiny() if smoke else dream7b(), "sdar": tiny_sdar() if smoke else sdar8b()}[
                name
            ]
            self.model = self.run.model(config)
        self.model_name = name
        self.counter = ForwardCounter(self.model).__enter__()
        print(
            f"[model] {name} ({self.model.config.model_id}) ready in {time.perf_counter() - t:.1f}s",
            flush=True,
        )
        return self.model

    def drop(self) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        self.model = self.counter = self.shipped = self.model_name = self.rounds = None
        self.engines.clear()
        self.run.free()

    def engine(self, kind: str) -> PrefillingEngine:
        """The pdllm engine over the Dream model (its rounds' default attention): ``loop`` decodes through it,
        ``rounds`` only prefills and builds."""
        model = self.use("dream")
        if kind not in self.engines:
            smoke = self.run.smoke
            ecfg = EngineConfig(chunk_size=64 if smoke else 1024, top_k=2 if smoke else 4)
            self.engines[kind] = PrefillingEngine(model, None, ecfg, reuse_chunks=False)
        return self.engines[kind]

    def ids(self, n: int, seed: int) -> list[int]:
        return random_ids(n, self.model.config.vocab_size, torch.Generator().manual_seed(seed))

    def query(self) -> list[int]:
        return self.ids(QUERY_TOKENS, 1)

    def context(self, n: int) -> list[int]:
        return self.ids(n, 1000 + n)

    def whole_prompt(self, context: int) -> list[int]:
        return [self.model.config.bos_token_id, *self.context(context), *self.query()]

    def gen(self, gen: int, steps: int | None = None) -> GenerationConfig:
        return GenerationConfig(
            gen_length=gen, steps=steps or gen, block_length=self.block, stop_at_eos=False
        )

    def meta(self, case: str) -> dict:
        return self.cases[case]

    def skip(self, case: str, where: dict, reason: str) -> None:
        self.cases[case]["skipped"].append({**where, "reason": reason})
        print(f"[skip] {case} {json.dumps(where)}: {reason}", flush=True)

    def error(self, case: str, where: dict, exc: BaseException) -> None:
        self.cases[case]["errors"].append({**where, "error": f"{type(exc).__name__}: {exc}"[:400]})
        print(f"[error] {case} {json.dumps(where)}: {self.cases[case]['errors'][-1]['error']}", flush=True)

    def add(self, row: dict) -> None:
        """A result row: the common keys first (missing ones None), then the case's own."""
        full = {k: row.get(k) for k in ROW_KEYS} | {k: v for k, v in row.items() if k not in ROW_KEYS}
        self.rows.append(full)
        short = {k: v for k, v in full.items() if k != "cache"}
        print(f"[row] {json.dumps(short, default=str)}", flush=True)


def per_round(forwards: int, rounds: int) -> float | None:
    return forwards / rounds if rounds else None


def tpf_of(tokens_per_request: float, forwards: int) -> float | None:
    return tokens_per_request / forwards if forwards else None


def speedup(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None
