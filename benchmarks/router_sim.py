"""A discrete-event simulation of pdllm's router with prefill and decode workers (one GPU each), driven by
measured costs; ``prefill_decode_ratio.py`` uses it to pick an 8-GPU node's prefill:decode ratio.

  prefill worker   FIFO, one request at a time, ``prefill_s`` each (+ ``build_s`` when the decode KV is built
                   on the prefill side).
  decode worker    the scheduler's loop: admit waiting requests while fewer than ``max_active`` are
                   building or decoding; per iteration at most one decode-KV build (built on the decode side:
                   its GPU time adds to the iteration, as the build shares the GPU with the rounds), then one
                   batched round over every active session, ``round_s(active)`` long; a session leaves after
                   ``steps`` rounds. A handed-off KV joins ``handoff_s`` after admission (the pull).
  router           least-loaded: prefill to the worker with the fewest outstanding requests (equal-length
                   prompts: the fewest outstanding tokens, as ``router/routing.py`` counts), decode to the
                   one with the fewest in flight; ties to the lowest index.
Arrivals: Poisson at ``rate`` (open loop), or ``concurrency`` clients each sending again when answered.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoundCurve:
    """Round time (s) vs active sessions: linear between the measured points, extended with the slope of the
    nearest segment outside them."""

    active: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: int) -> float:
        i = min(max(bisect.bisect_left(self.active, n), 1), len(self.active) - 1)
        (a0, a1), (s0, s1) = self.active[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return max(s0 + (s1 - s0) * (n - a0) / (a1 - a0), 1e-9)


@dataclass
class SimConfig:
    prefill_workers: int
    decode_workers: int
    prefill_s: float
    build_s: float
    handoff_s: float
    steps: int
    round_s: Callable[[int], float]
    placement: str = "decode"  # where the decode KV is built: "decode" | "prefill"
    rate: float = 0.0  # Poisson arrivals per second (open loop) ...
    concurrency: int = 0  # ... or this many clients, each sending again on completion (closed loop)
    requests: int = 3000
    warmup: int = 300
    max_active: int = 64
    seed: int = 0


@dataclass
class _Request:
    index: int
    arrival: float
    first_round: float = -1.0
    done: float = -1.0


@dataclass
class _Decode:
    waiting: deque = field(default_factory=deque)
    builds: deque = field(default_factory=deque)
    joining: list = field(default_factory=list)  # (ready time, index, request)
    finishing: dict = field(default_factory=dict)  # iteration -> requests leaving after it
    active: int = 0
    iteration: int = 0
    running: bool = False
    busy_s: float = 0.0
    gaps: list = field(default_factory=list)  # (start, iteration s, sessions that waited it for a step)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.builds) + len(self.joining) + self.active


def simulate(cfg: SimConfig) -> dict:
    """One run of the router + workers; returns throughput, latency percentiles and utilizations."""
    rng = random.Random(cfg.seed)
    events: list = []
    seq = iter(range(1 << 62))

    def at(t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    requests: list[_Request] = []
    prefill_queue = [deque() for _ in range(cfg.prefill_workers)]  # head = in service
    prefill_busy = [0.0] * cfg.prefill_workers
    decoders = [_Decode() for _ in range(cfg.decode_workers)]
    service = cfg.prefill_s + (cfg.build_s if cfg.placement == "prefill" else 0.0)

    def arrive(t: float) -> None:
        req = _Request(len(requests), t)
        requests.append(req)
        w = min(range(cfg.prefill_workers), key=lambda i: (len(prefill_queue[i]), i))
        prefill_queue[w].append(req)
        if len(prefill_queue[w]) == 1:
            at(t + service, "prefilled", w)

    def kick(d: int, t: float) -> None:
        if not decoders[d].running:
            decoders[d].running = True
            at(t, "iterate", d)

    def iterate(d: int, t: float) -> None:
        w = decoders[d]
        while w.waiting and len(w.builds) + len(w.joining) + w.active < cfg.max_active:
            req = w.waiting.popleft()
            if cfg.placement == "prefill":
                heapq.heappush(w.joining, (t + cfg.handoff_s, req.index, req))
            else:
                w.builds.append(req)
        dur = 0.0
        if w.builds:  # one build per iteration: it shares the GPU with this iteration's round
            req = w.builds.popleft()
            dur += cfg.build_s
            heapq.heappush(w.joining, (t + dur, req.index, req))
        joined = []
        while w.joining and w.joining[0][0] <= t + dur:
            _, _, req = heapq.heappop(w.joining)
            joined.append(req)
            w.active += 1
            w.finishing.setdefault(w.iteration + cfg.steps - 1, []).append(req)
        if w.active:
            dur += cfg.round_s(w.active)
            end = t + dur
            w.gaps.append((t, dur, w.active - len(joined)))
            for req in joined:  # its first partial output
                req.first_round = end
            for req in w.finishing.pop(w.iteration, []):
                req.done = end
                w.active -= 1
                at(end, "done", req)
            w.iteration += 1
        w.busy_s += dur
        if dur == 0.0 and w.joining:  # only pulls in flight: wake when the first one lands
            at(w.joining[0][0], "iterate", d)
        elif dur > 0.0:
            at(t + dur, "iterate", d)
        else:
            w.running = False

    if cfg.concurrency:
        for _ in range(min(cfg.concurrency, cfg.requests)):
            arrive(0.0)
    else:
        t = 0.0
        for _ in range(cfg.requests):
            t += rng.expovariate(cfg.rate)
            at(t, "arrive")
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            arrive(t)
        elif kind == "prefilled":
            w = payload
            req = prefill_queue[w].popleft()
            prefill_busy[w] += service
            if prefill_queue[w]:
                at(t + service, "prefilled", w)
            d = min(range(cfg.decode_workers), key=lambda i: (decoders[i].in_flight, i))
            decoders[d].waiting.append(req)
            kick(d, t)
        elif kind == "iterate":
            iterate(payload, t)
        elif kind == "done" and cfg.concurrency and len(requests) < cfg.requests:
            arrive(t)
    return _summary(cfg, requests, prefill_busy, decoders)


def _summary(
    cfg: SimConfig, requests: list[_Request], prefill_busy: list[float], decoders: list[_Decode]
) -> dict:
    kept = [r for r in requests[cfg.warmup :] if r.done >= 0]
    if cfg.concurrency:  # warmup 0: one burst measured from its first send, as serving.py does
        ends = sorted(r.done for r in requests)
        t0, t1 = (ends[cfg.warmup - 1] if cfg.warmup else 0.0), ends[-1]
    else:
        t0, t1 = requests[cfg.warmup].arrival, requests[-1].arrival
    finished = sum(1 for r in requests if t0 < r.done <= t1)
    latency = sorted(r.done - r.arrival for r in kept)
    ttft = sorted(r.first_round - r.arrival for r in kept)
    span = max(r.done for r in requests)
    # A session's step gap is the iteration it waited through (round, plus a build run beside it).
    gaps = sorted((g, n) for w in decoders for start, g, n in w.gaps if start >= t0 and n)
    return {
        "throughput_req_s": finished / (t1 - t0),
        "latency_mean_s": sum(latency) / max(1, len(latency)),
        "latency_p50_s": _pct(latency, 0.5),
        "latency_p99_s": _pct(latency, 0.99),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "step_p50_ms": _weighted_pct(gaps, 0.5) * 1e3,
        "step_p99_ms": _weighted_pct(gaps, 0.99) * 1e3,
        "prefill_util": sum(prefill_busy) / (cfg.prefill_workers * span),
        "decode_util": sum(w.busy_s for w in decoders) / (cfg.decode_workers * span),
    }


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, int(q * len(values) + 0.999999) - 1))]


def _weighted_pct(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """Nearest-rank percentile of sorted (value, count) pairs."""
    total = sum(n for _, n in pairs)
    if not total:
        return float("nan")
    rank, seen = max(1, int(q * total + 0.999999)), 0
    for value, n in pairs:
        seen += n
        if seen >= rank:
            return value
    return pairs[-1][0]
