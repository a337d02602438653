"""``--schedule FILE``: the rounds and focus-batched cases' requests unmask as a recorded decode did
(``pdllm eval --record-schedule``), so random weights decode at a real tokens-per-forward.

Request ``i`` of a cell replays recorded sample ``i mod N`` (the file's samples, in order, those matching
``--schedule-select``), fitted to the cell's blocks by ``schedule.replayed_spans``: each block is cut into
pieces of the sample's recorded block length (at absolute multiples of it: block diffusion's alignment),
piece ``g`` replays recorded block ``g mod (recorded blocks)`` (a decode that stopped at EOS recorded only
its blocks up to the EOS, so a longer answer repeats them), its counts read in order, cycling, until they
cover the piece, the step that would pass it cut to fit. Recorded and replayed at one block length, block
``b`` replays recorded block ``b``; an SDAR judge recorded at ``--block-length 4`` and replayed in blocks
of 32 replays per 4-token block. Each step unmasks exactly its count (``GenerationConfig.schedule``), so
every shape of a round, its graph bucket included, is the same in the capture run and the timed run.

Replayed work: a sample recorded under FOCUS, DyLLM or Polestar-Cache also holds its policy's work
fractions (``schedule.policy_fractions``). :meth:`Replay.knobs` turns the selected samples' mean fractions
into that policy's ``replay_*`` config fields (:data:`REPLAYED_KNOBS`), which keep the policy's scores and
kernels and force only its count: FOCUS retains the top ``ceil(f x block rows)`` masked rows by its
importance delta, DyLLM makes the ``ceil(f x queried rows)`` most drifted rows salient at each layer of a
SparseStep, Polestar recomputes ``ceil(r)`` rows per layer at each update and updates at the recorded rate
per forward. A schedule without a policy's fractions leaves that policy to its own choices; rows say which
(:meth:`Replay.sparsity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.generation.schedule import (
    Schedule,
    as_schedule,
    load_schedules,
    parse_select,
    policy_fractions,
    replayed_spans,
    schedule_tpf,
)

Spans = Sequence[tuple[int, int]]

FITTING = (
    "request i replays recorded sample i mod N; each block is cut into pieces of the recorded block length "
    "(at absolute multiples of it), piece g replays recorded block g mod (blocks recorded), its counts "
    "cycled until they cover the piece, the last cut to fit"
)


# Per policy, each recorded fraction (``schedule.policy_fractions``' keys) and the config field replaying it.
REPLAYED_KNOBS: dict[str, dict[str, str]] = {
    "focus": {"retained_frac": "replay_retained_frac"},
    "dyllm": {"ffn_frac": "replay_ffn_frac"},
    "polestar": {
        "recomputed_rows_per_update_layer": "replay_rows_per_update_layer",
        "updates_per_forward": "replay_updates_per_forward",
    },
}


@dataclass(frozen=True)
class Replay:
    """The recorded samples a run replays, and where they came from."""

    path: Path
    header: dict[str, Any]
    samples: list[dict[str, Any]]
    select: str

    @classmethod
    def load(cls, path: Path, select: str | None) -> Replay:
        header, samples = load_schedules(path, parse_select(select))
        return cls(Path(path), header, samples, select or "")

    def schedules(
        self, gen: GenerationConfig, n: int, spans: Spans | None = None, start: int = 0
    ) -> list[Schedule]:
        """The schedules of a cell's ``n`` requests, fitted to ``gen``'s blocks, or to ``spans`` (a block
        diffusion request's, aligned to absolute positions; its answer starting at ``start``)."""
        if spans is None:
            spans = [(b * gen.block, (b + 1) * gen.block) for b in range(gen.num_blocks)]
        picked = [self.samples[i % len(self.samples)] for i in range(n)]
        # a sample without its block length: one piece per block
        return [replayed_spans(as_schedule(s["steps"]), spans, s.get("block_length") or gen.block, start)
                for s in picked]  # fmt: skip

    def gens(
        self, gen: GenerationConfig, n: int, spans: Spans | None = None, start: int = 0
    ) -> list[GenerationConfig]:
        """``gen`` for each of a cell's ``n`` requests, with its replayed schedule (``spans``, ``start``: as
        :meth:`schedules`)."""
        return [replace(gen, schedule=s) for s in self.schedules(gen, n, spans, start)]

    def columns(
        self, gen: GenerationConfig, n: int, spans: Spans | None = None, start: int = 0
    ) -> dict[str, Any]:
        """A replayed row's own columns: ``recorded_tpf`` (the eval's TPF of the samples replayed: answer
        tokens up to EOS over forwards, pooled) and ``schedule_tpf`` (tokens per step of the schedules as
        replayed: every slot unmasked, fitted to the cell)."""
        used = [self.samples[i % len(self.samples)] for i in range(min(n, len(self.samples)))]
        forwards = sum(s["forwards"] for s in used)
        fitted = self.schedules(gen, n, spans, start)
        cells = sorted({f"{s.get('method')}/{s.get('decode_policy')}/{s.get('threshold')}" for s in used})
        return {
            "replayed": True,
            "recorded_tpf": round(sum(s["tokens"] for s in used) / forwards, 4) if forwards else None,
            "schedule_tpf": round(sum(map(sum, map(_flat, fitted))) / sum(len(_flat(s)) for s in fitted), 4),
            "schedule_samples": len(used),
            "schedule_cells": ",".join(cells),
            "schedule_model": self.header.get("model"),
        }

    def fractions(self, policy: str) -> dict[str, float]:
        """``policy``'s recorded work fractions, each the mean over the selected samples that hold it ({}:
        none does, or the policy has no replayed work)."""
        out = {}
        for key in REPLAYED_KNOBS.get(policy, {}):
            values = [s["fractions"][key] for s in self.samples if key in (s.get("fractions") or {})]
            if values:
                out[key] = round(sum(values) / len(values), 4)
        return out

    def knobs(self, policy: str) -> dict[str, float]:
        """The ``replay_*`` config fields forcing :meth:`fractions` on ``policy`` ({}: left unforced)."""
        return {REPLAYED_KNOBS[policy][k]: v for k, v in self.fractions(policy).items()}

    def sparsity(self, policy: str, caches: list[dict[str, Any]], num_layers: int) -> dict[str, Any]:
        """A replayed row's work columns for a policy with replayed work ({} for the others):
        ``replayed_fractions`` (what was forced; None: nothing recorded), ``sparsity`` (``replayed`` or
        ``own``: why) and ``measured_fractions`` (``policy_fractions`` of the run's counters, ``caches``,
        summed over its requests)."""
        if policy not in REPLAYED_KNOBS:
            return {}
        forced = self.fractions(policy) or None
        why = "replayed" if forced else f"own: the schedule records no {policy} fractions"
        pooled: dict[str, Any] = {}
        for cache in caches:
            for k, v in cache.items():
                pooled[k] = pooled.get(k, 0) + v if isinstance(v, int) else v
        measured = policy_fractions(pooled, num_layers) if pooled else None
        return {"replayed_fractions": forced, "sparsity": why, "measured_fractions": measured}

    def note(self) -> str:
        """What a case's setup says of the replay."""
        tpf = schedule_tpf(tuple(b for s in self.samples for b in as_schedule(s["steps"])))
        work = "; ".join(f"{p} {self.fractions(p)}" for p in REPLAYED_KNOBS if self.fractions(p))
        return (
            f"Replayed schedules: {self.path.name} ({len(self.samples)} samples"
            f"{', ' + self.select if self.select else ''}; recorded on {self.header.get('model')}, "
            f"{tpf:.2f} tokens per step as recorded); {FITTING}. Replayed work (mean recorded fractions, "
            f"forced where a case runs that policy): {work or 'none recorded, every policy makes its own choices'}."
        )


def _flat(schedule: Schedule) -> list[int]:
    return [n for block in schedule for n in block]


def replayed_tokens(schedules: list[Schedule], rounds: int) -> int:
    """Tokens ``schedules``' requests unmask in their first ``rounds`` rounds (each request one step per
    round until it is done)."""
    return sum(sum(_flat(s)[:rounds]) for s in schedules)
