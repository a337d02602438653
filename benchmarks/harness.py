"""What a decode benchmark needs besides its measurements (``decode_engine.py``): the run's device, dtype and
time budget (``--smoke``: CPU, float32, tiny shapes), models built from ``shapes.py``, timing with a device
sync and a warm-up, counting model forwards, and the report: ``<out>/<name>.json`` + ``<name>.md`` with the
device, date and command of the run.

Forwards (:class:`ForwardCounter`) are passes through the model's layer stack, counted at the token
embedding: every forward path calls it once per pass (``DiffusionLM.hidden_states``, the decode rounds, the
policies' own per-layer loops, chunk prefill). A CUDA graph replay counts the passes its capture recorded (a
captured round or step: one); passes recorded during a capture run nothing and are not counted themselves.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import build_model, sync  # noqa: E402
from pdllm.shared.model.config import ModelConfig  # noqa: E402
from pdllm.shared.model.transformer import DiffusionLM  # noqa: E402

_MISSING = object()


def add_run_args(ap: argparse.ArgumentParser, budget_s: float) -> None:
    """The arguments every harness benchmark takes."""
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, tiny shapes: seconds")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results (smoke: a temp dir)")
    ap.add_argument("--name", default=None, help="output file stem (default: the benchmark's name)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=budget_s,
        help="measured seconds: runs that would end past it are skipped, with the reason recorded",
    )


@dataclass
class Run:
    """One benchmark run: where it runs, in which dtype, and its clock against ``budget_s``."""

    smoke: bool
    device: torch.device
    dtype: torch.dtype
    budget_s: float
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def from_args(cls, args: argparse.Namespace, needs_gpu: bool = True) -> Run:
        """``--smoke``, or GPU work without a CUDA device: tiny shapes, CPU and float32; else the GPU in
        bfloat16 (``needs_gpu`` False: measurements that run anywhere keep their full size on a CPU)."""
        cuda = torch.cuda.is_available()
        smoke = args.smoke or (needs_gpu and not cuda)
        device = torch.device("cpu" if smoke or not cuda else "cuda")
        return cls(smoke, device, torch.float32 if device.type == "cpu" else torch.bfloat16, args.budget_s)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    def model(self, config: ModelConfig) -> DiffusionLM:
        """Random weights of ``config``'s shapes on the device (``shapes.build_model``)."""
        return build_model(config, self.device, self.dtype)

    def free(self) -> None:
        """Return what dropped references held (models, KV pools, graphs) to the device."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def default_out(smoke: bool, name: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{name}_smoke" if smoke else Path("benchmarks/results")


# ---------------------------------------------------------------------------------------- timing
def reset_peak(device: torch.device) -> None:
    """Start a measurement clean: free cached blocks and reset the allocator's peak."""
    if device.type == "cuda":
        gc.collect()  # the previous run's caches and graphs
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    """The CUDA allocator's peak since :func:`reset_peak`, weights included (0 on CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


@dataclass
class Timed:
    seconds: float
    peak_gib: float
    value: Any


def timed(device: torch.device, fn: Callable[[], Any], warm: Callable[[], Any] | None = None) -> Timed:
    """``warm()`` (untimed), then ``fn()`` between device syncs: its seconds, peak GiB and result."""
    if warm is not None:
        warm()
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return Timed(time.perf_counter() - start, peak_gib(device), value)


# ---------------------------------------------------------------------------------------- forwards
class ForwardCounter:
    """Counts ``model``'s forwards (module docstring) while installed (``with counter:``); :meth:`tally`
    reads the count over a block, :meth:`excluding` leaves some methods' passes out (a request's prefill).
    One counter is installed at a time; install it before the graphs it should count are captured."""

    _active: ForwardCounter | None = None

    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self.count = 0
        self._paused = 0
        self._capturing: list[int] = []  # ids of the graphs being captured, innermost last
        self._graph_passes: dict[int, int] = {}
        self._handle: Any = None
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> ForwardCounter:
        if ForwardCounter._active is not None:
            raise RuntimeError("another ForwardCounter is installed")
        ForwardCounter._active = self
        self._handle = self.model.model.embed_tokens.register_forward_hook(self._hook)
        graph = torch.cuda.CUDAGraph
        self._saved = {n: graph.__dict__[n] for n in ("capture_begin", "capture_end", "replay")}
        counter = self

        def capture_begin(g: Any, *args: Any, **kwargs: Any) -> Any:
            counter._capturing.append(id(g))
            counter._graph_passes[id(g)] = 0
            return counter._saved["capture_begin"](g, *args, **kwargs)

        def capture_end(g: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return counter._saved["capture_end"](g, *args, **kwargs)
            finally:
                if counter._capturing and counter._capturing[-1] == id(g):
                    counter._capturing.pop()

        def replay(g: Any, *args: Any, **kwargs: Any) -> Any:
            if not counter._paused:
                counter.count += counter._graph_passes.get(id(g), 0)
            return counter._saved["replay"](g, *args, **kwargs)

        graph.capture_begin, graph.capture_end, graph.replay = capture_begin, capture_end, replay  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        for name, fn in self._saved.items():
            setattr(torch.cuda.CUDAGraph, name, fn)
        ForwardCounter._active = None

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if self._capturing and torch.cuda.is_current_stream_capturing():
            self._graph_passes[self._capturing[-1]] += 1
        elif not self._paused:
            self.count += 1

    @contextmanager
    def tally(self) -> Iterator[Tally]:
        """``with counter.tally() as t:`` ... ``t.forwards``: the forwards counted inside the block."""
        t = Tally()
        start = self.count
        try:
            yield t
        finally:
            t.forwards = self.count - start

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextmanager
    def excluding(self, owner: Any, *names: str) -> Iterator[None]:
        """Within the block, passes run inside ``owner``'s methods ``names`` (an instance's or a class's)
        are not counted."""
        saved = {n: vars(owner).get(n, _MISSING) for n in names}
        for n in names:
            fn = getattr(owner, n)

            def wrapper(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
                with self.paused():
                    return _fn(*args, **kwargs)

            setattr(owner, n, wrapper)
        try:
            yield
        finally:
            for n, old in saved.items():
                if old is _MISSING:
                    delattr(owner, n)
                else:
                    setattr(owner, n, old)


@dataclass
class Tally:
    forwards: int = 0


# ---------------------------------------------------------------------------------------- report
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (a copied tree)
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_meta(script: str, argv: list[str] | None, run: Run) -> dict:
    """Where, when and how: device, date, the command line, torch, the checkout's commit."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "device": run.device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", f"benchmarks/{script}", *args]),
        "smoke": run.smoke,
        "torch": torch.__version__,
        "dtype": str(run.dtype),
        "commit": git_commit(),
        "budget_s": run.budget_s,
    }


def write_report(out: Path, name: str, report: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # default=str: a value JSON lacks (a dtype, a path) is written as its text, not a lost report
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown)


def fmt(value: object, spec: str = ".2f") -> str:
    """A table cell: floats by ``spec``, None as a dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]
