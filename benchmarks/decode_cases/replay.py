"""``--schedule FILE``: the rounds cases' requests unmask as a recorded decode did (``pdllm eval
--record-schedule``), so random weights decode at a real tokens-per-forward.

Request ``i`` of a cell replays recorded sample ``i mod N`` (the file's samples, in order, those matching
``--schedule-select``), fitted to the cell's gen and block length by ``schedule.replayed``: block ``b``
replays recorded block ``b mod (recorded blocks)`` (a decode that stopped at EOS recorded only its blocks up
to the EOS, so a longer answer repeats them), its counts read in order, cycling, until they cover the block,
the step that would pass it cut to fit. Each step unmasks exactly its count (``GenerationConfig.schedule``),
so every shape of a round, its graph bucket included, is the same in the capture run and the timed run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.generation.schedule import (
    Schedule,
    as_schedule,
    load_schedules,
    parse_select,
    replayed,
    schedule_tpf,
)

FITTING = (
    "request i replays recorded sample i mod N; block b replays recorded block b mod (blocks recorded), "
    "its counts cycled until they cover the block, the last cut to fit"
)


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

    def schedules(self, gen: GenerationConfig, n: int) -> list[Schedule]:
        """The schedules of a cell's ``n`` requests, fitted to ``gen``."""
        picked = [self.samples[i % len(self.samples)]["steps"] for i in range(n)]
        return [replayed(as_schedule(s), gen.gen_length, gen.block) for s in picked]

    def gens(self, gen: GenerationConfig, n: int) -> list[GenerationConfig]:
        """``gen`` for each of a cell's ``n`` requests, with its replayed schedule."""
        return [replace(gen, schedule=s) for s in self.schedules(gen, n)]

    def columns(self, gen: GenerationConfig, n: int) -> dict[str, Any]:
        """A replayed row's own columns: ``recorded_tpf`` (the eval's TPF of the samples replayed: answer
        tokens up to EOS over forwards, pooled) and ``schedule_tpf`` (tokens per step of the schedules as
        replayed: every slot unmasked, fitted to the cell)."""
        used = [self.samples[i % len(self.samples)] for i in range(min(n, len(self.samples)))]
        forwards = sum(s["forwards"] for s in used)
        fitted = self.schedules(gen, n)
        cells = sorted({f"{s.get('method')}/{s.get('decode_policy')}/{s.get('threshold')}" for s in used})
        return {
            "replayed": True,
            "recorded_tpf": round(sum(s["tokens"] for s in used) / forwards, 4) if forwards else None,
            "schedule_tpf": round(sum(map(sum, map(_flat, fitted))) / sum(len(_flat(s)) for s in fitted), 4),
            "schedule_samples": len(used),
            "schedule_cells": ",".join(cells),
            "schedule_model": self.header.get("model"),
        }

    def note(self) -> str:
        """What a case's setup says of the replay."""
        tpf = schedule_tpf(tuple(b for s in self.samples for b in as_schedule(s["steps"])))
        return (
            f"Replayed schedules: {self.path.name} ({len(self.samples)} samples"
            f"{', ' + self.select if self.select else ''}; recorded on {self.header.get('model')}, "
            f"{tpf:.2f} tokens per step as recorded); {FITTING}."
        )


def _flat(schedule: Schedule) -> list[int]:
    return [n for block in schedule for n in block]


def replayed_tokens(schedules: list[Schedule], rounds: int) -> int:
    """Tokens ``schedules``' requests unmask in their first ``rounds`` rounds (each request one step per
    round until it is done)."""
    return sum(sum(_flat(s)[:rounds]) for s in schedules)
