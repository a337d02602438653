"""Unmask schedules: how many tokens each denoising step unmasked, recorded from a decode and replayed.

A schedule lists, per block of the response, the tokens unmasked at each step of that block
(``((3, 1), (2, 2))``: block 0 took two steps, unmasking 3 then 1). ``pdllm eval --record-schedule FILE``
writes one per decoded sample (:func:`sample_record`, :func:`write_schedules`); a
:class:`~.sampler.GenerationConfig` with ``schedule`` set replays one: step ``i`` of block ``b`` unmasks
exactly the recorded count, the most confident masked positions of the block, by the fixed-schedule rule
of :class:`~.sampler.DenoiseState` (so the decode worker's device states replay it without reading the
device back).

A replayed response need not have the recorded one's shape. :func:`block_counts` fits it: block ``b``
replays recorded block ``b mod (recorded blocks)`` (a decode that stopped at EOS recorded only its blocks
up to the EOS), its counts read in order, cycling, until they cover the block's length; the step that
would pass the length is cut to it. Replayed in longer blocks than recorded (:func:`replayed_spans`), a
block is first cut into pieces of the recorded block length, each replaying one recorded block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Schedule = tuple[tuple[int, ...], ...]
"""Per block of the response, the tokens unmasked at each of its steps."""

FORMAT = "pdllm-unmask-schedule/1"


def check_schedule(schedule: Schedule) -> None:
    """Raise ValueError unless ``schedule`` has at least one block and every block >= 1 positive count."""
    if not schedule or any(not block for block in schedule):
        raise ValueError("schedule must list at least one block, each with at least one step")
    if any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for block in schedule for n in block):
        raise ValueError(f"schedule counts must be positive integers, got {schedule}")


def fit_counts(counts: Sequence[int], length: int) -> list[int]:
    """``counts`` read in order, cycling, until they sum to ``length``; the last one cut to fit."""
    if length <= 0 or not counts:
        raise ValueError(f"need a positive length and some counts, got {length} and {list(counts)}")
    out: list[int] = []
    left, i = length, 0
    while left > 0:
        n = min(counts[i % len(counts)], left)
        out.append(n)
        left -= n
        i += 1
    return out


def block_counts(schedule: Schedule, block: int, length: int) -> list[int]:
    """Tokens each step of block ``block`` (``length`` positions) unmasks when replaying ``schedule``."""
    return fit_counts(schedule[block % len(schedule)], length)


def replayed(schedule: Schedule, gen_length: int, block: int, unit: int | None = None) -> Schedule:
    """``schedule`` fitted to a response of ``gen_length`` in blocks of ``block`` (pieces of ``unit``, the
    recorded block length: :func:`replayed_spans`): what a replay runs."""
    spans = [(b * block, (b + 1) * block) for b in range(gen_length // block)]
    return replayed_spans(schedule, spans, unit or block)


def replayed_spans(
    schedule: Schedule, spans: Sequence[tuple[int, int]], unit: int, start: int = 0
) -> Schedule:
    """``schedule`` fitted to a response decoded in blocks ``spans`` (response ``[lo, hi)``; position 0 at
    absolute position ``start``), one recorded block per piece: each span is cut at absolute multiples of
    ``unit`` (the recorded block length), piece ``g`` of the response replays recorded block
    ``g mod (recorded blocks)`` (:func:`fit_counts`), and a span's steps are its pieces' in order.

    With ``unit`` a multiple of the spans' block length (their boundaries on its multiples) every span is
    one piece: block ``b`` replays recorded block ``b``. A smaller unit is a recording in shorter blocks, e.g. block diffusion (SDAR) decoded at its
    model block of 4 and replayed in generation blocks of 32: each 4-token piece then takes the steps one
    recorded 4-token block took (pieces aligned to absolute positions, as SDAR aligns its blocks, so a
    partial first block replays the recorded partial first block), and the replay keeps its tokens per
    forward; cycling one recorded block over 32 positions would not (a recorded 1-token first block would
    pace a whole 32-token block at one token per step)."""
    if unit <= 0:
        raise ValueError(f"unit must be positive, got {unit}")
    out: list[tuple[int, ...]] = []
    g = 0
    for lo, hi in spans:
        steps: list[int] = []
        a = lo
        while a < hi:
            b = min(hi, ((start + a) // unit + 1) * unit - start)
            steps += block_counts(schedule, g, b - a)
            g, a = g + 1, b
        out.append(tuple(steps))
    return tuple(out)


def schedule_tpf(schedule: Schedule) -> float:
    """Tokens per step over the whole schedule (every unmasked slot, after an EOS too)."""
    return sum(map(sum, schedule)) / sum(map(len, schedule))


def as_schedule(value: Sequence[Sequence[int]]) -> Schedule:
    """A recorded ``steps`` list (JSON lists) as a checked :data:`Schedule`."""
    schedule = tuple(tuple(int(n) for n in block) for block in value)
    check_schedule(schedule)
    return schedule


def policy_fractions(cache: Mapping[str, Any], num_layers: int) -> dict[str, float]:
    """What a decode policy's counters (``GenerationResult.cache``) say of its work, pooled over the
    request's forwards and layers: DyLLM's salient share (rows whose K/V and context were recomputed) and
    FFN share; FOCUS's retained share of rows past layer 1; Polestar's recomputed rows per update and
    layer (a count: the cached rows it could recompute depend on the request's local rows)."""
    policy = cache.get("policy")
    out: dict[str, float] = {}
    if policy == "dyllm" and cache.get("rows_total"):
        out["salient_frac"] = cache["kv_rows"] / cache["rows_total"]
        out["ffn_frac"] = cache["rows_forwarded"] / cache["rows_total"]
    elif isinstance(policy, str) and policy.startswith("focus") and cache.get("rows_plain"):
        out["retained_frac"] = cache["rows_forwarded"] / cache["rows_plain"]
    elif policy == "polestar" and cache.get("updates"):
        out["recomputed_rows_per_update_layer"] = cache["rows_recomputed"] / (cache["updates"] * num_layers)
        out["updates_per_forward"] = cache["updates"] / max(1, cache.get("forwards", 0))
    return {k: round(v, 4) for k, v in out.items()}


def sample_record(
    cell: Mapping[str, Any],
    steps: Sequence[Sequence[int]],
    gen_length: int,
    block_length: int,
    tokens: int,
    cache: Mapping[str, Any],
    num_layers: int,
) -> dict[str, Any]:
    """One decoded sample's entry of a schedule file: its ``cell`` (method, policy, threshold, task,
    sample id, ...), ``steps`` (tokens unmasked per step, per block), its shape, its TPF (``tokens``: the
    eval's answer tokens up to EOS, over its steps) and its policy's counters and fractions."""
    forwards = sum(map(len, steps))
    return {
        **cell,
        "gen_length": gen_length,
        "block_length": block_length,
        "steps": [list(block) for block in steps],
        "tokens": tokens,
        "forwards": forwards,
        "tpf": round(tokens / forwards, 4) if forwards else None,
        "policy_stats": dict(cache),
        "fractions": policy_fractions(cache, num_layers),
    }


def write_schedules(path: Path, header: Mapping[str, Any], samples: list[dict[str, Any]]) -> None:
    """The schedule file: ``header`` (model, command, ...) and one record per sample, one line each."""
    # One line per sample: json's indent would put every count on a line of its own.
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(s, separators=(",", ":")) for s in samples)
    head = json.dumps({"format": FORMAT, **header})[:-1]  # the header's fields, then the samples
    path.write_text(f'{head}, "samples": [\n{lines}\n]}}\n', encoding="utf-8")


def parse_select(text: str | None) -> dict[str, str]:
    """``key=value,...`` (e.g. ``method=pdllm,threshold=0.9``) as a dict; None or empty: no filter."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if item.strip():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"schedule selection {item!r} is not key=value")
            out[key.strip()] = value.strip()
    return out


def _matches(sample: Mapping[str, Any], select: Mapping[str, str]) -> bool:
    # compared as JSON text, so threshold=0.9, threshold=null and task=needle all read as written
    def text(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    return all(key in sample and text(sample[key]) == want for key, want in select.items())


def load_schedules(path: Path, select: Mapping[str, str] | None = None) -> tuple[dict[str, Any], list[dict]]:
    """A schedule file's header and its samples matching ``select`` (each key equal to the value as
    written), in file order; each sample's ``steps`` checked. Raises ValueError when none matches."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a schedule file (format {data.get('format')!r}, want {FORMAT!r})")
    samples = [s for s in data["samples"] if _matches(s, select or {})]
    if not samples:
        raise ValueError(f"{path}: no sample matches {dict(select or {})} among {len(data['samples'])}")
    for s in samples:
        as_schedule(s["steps"])
    header = {k: v for k, v in data.items() if k != "samples"}
    return header, samples
