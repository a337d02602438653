"""The ``focus-batched`` case: FOCUS in the decode worker's rounds against plain block diffusion in the same
rounds, on SDAR shapes; with ``--schedule``, both at replayed unmask counts (request ``i`` replays the same
schedule in each run, so they compare at equal tokens per forward), and FOCUS at the schedule's recorded
retained share where it has one (``replay.Replay.knobs``)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks.decode_cases.bench import Bench, per_round, speedup, tpf_of
from benchmarks.decode_cases.replay import replayed_tokens
from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids
from benchmarks.harness import peak_gib, reset_peak
from benchmarks.shapes import sync
from pdllm.decode_service import block_rounds
from pdllm.decode_service.block_diffusion import answer_spans, generation_block
from pdllm.decode_service.block_rounds import block_slots, start_block_decode
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.policies.focus import FocusConfig
from pdllm.decode_service.request import DecodeRequest, Final, Status
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.sdar_focus_rounds import sdar_focus_slots
from pdllm.shared.generation.sampler import GenerationConfig


def case_focus_batched(bench: Bench) -> None:
    a, case = bench.args, "focus-batched"
    model = bench.use("sdar")
    rng = torch.Generator().manual_seed(1)
    for batch in a.focus_batches:
        prompts = [[model.config.bos_token_id, *random_ids(a.vanilla_context + QUERY_TOKENS, model.config.vocab_size,
                                                            rng)] for _ in range(batch)]  # fmt: skip
        plain_rounds = None
        for focus, layer_graphs in ((None, True), (FocusConfig(), True), (FocusConfig(), False)):
            speed = sdar_rounds_row(bench, case, model, prompts, batch, focus, plain_rounds, layer_graphs)
            plain_rounds = speed if focus is None else plain_rounds
    pace = "one token per step" if bench.replay is None else "replayed schedules"
    bench.meta(case)["setup"] = (
        f"{model.config.model_id} (model block {model.config.block_size}), generation block {a.block}, prompt "
        f"{a.vanilla_context} context + {QUERY_TOKENS} question tokens, gen {a.focus_gen}, {pace}. "
        "plain-rounds: plain block diffusion in the decode worker's rounds (the scheduler, graph buckets, "
        "split-S attention over the pool; a finished block's record rides in the next round); focus-rounds: "
        "FOCUS in the same rounds (its selection is made inside the forward: attention eager, each layer's "
        "work around it replayed as CUDA graphs; focus-rounds-eager-layers: every op eager); all requests submitted "
        "at once, the prompts' prefill (the builds) in the time; round_ms: seconds / rounds."
    ) + ("" if bench.replay is None else " " + bench.replay.note())


def replayed_gens(
    bench: Bench, model: Any, prompt_tokens: int, gen: GenerationConfig, n: int
) -> list[GenerationConfig]:
    """``gen`` for each of ``n`` requests of ``prompt_tokens``: with ``--schedule``, request ``i``'s replayed
    schedule fitted to its block diffusion spans (aligned to absolute positions, so a span may be shorter
    than the block: fitting by block index alone would count steps the request never runs)."""
    if bench.replay is None:
        return [gen] * n
    spans = answer_spans(prompt_tokens, gen.gen_length, generation_block(gen, model.config.block_size))
    return bench.replay.gens(gen, n, spans, start=prompt_tokens)


def sdar_rounds_row(bench: Bench, case: str, model: Any, prompts: list[list[int]], batch: int,
                    focus: FocusConfig | None = None, plain_rounds: float | None = None,
                    layer_graphs: bool = True) -> float | None:  # fmt: skip
    """Block diffusion of ``prompts`` through the decode scheduler's rounds, all submitted at once: plain, or
    under FOCUS (``focus``; ``plain_rounds``: the plain run's tokens/s, for its ratio). Its tokens/s (None:
    not run)."""
    a = bench.args
    name = (
        "plain-rounds" if focus is None else "focus-rounds" if layer_graphs else "focus-rounds-eager-layers"
    )
    if focus is not None and bench.replay is not None:  # its recorded retained share, where recorded
        focus = replace(focus, **bench.replay.knobs("focus"))
    where = {"policy": name, "batch": batch, "gen_length": a.focus_gen}
    if bench.left() <= 0:
        bench.skip(case, where, "time budget spent")
        return
    counter = bench.counter
    assert counter is not None
    cuda = bench.run.cuda
    gen = bench.gen(a.focus_gen)
    page = 64
    slots = block_slots(len(prompts[0]), gen)
    if focus is not None:  # FOCUS's key regions after its positions
        slots = sdar_focus_slots(slots, gen, model.config.block_size, page)
    pool = DecodeKVPool.with_pages(model, batch * (-(-slots // page) + 1), page)
    forward = GraphedRoundForward(
        model, pool, "triton" if cuda else "torch", capture=cuda, layer_graphs=layer_graphs
    )

    def run(gens: list[GenerationConfig]) -> tuple[float, list[DecodeRequest], int]:
        sched = DecodeScheduler(model, pool, forward, start_thread=False)
        jobs = []
        for i, (prompt, g) in enumerate(zip(prompts, gens, strict=True)):
            tensor = torch.tensor(prompt, device=bench.device)
            start = lambda t=tensor, g=g: start_block_decode(model, t, g, focus=focus)  # noqa: E731
            jobs.append(DecodeRequest(f"s{i}", start, threading.Event(), False, cache_tokens=slots))
        sync(bench.device)
        begin = time.perf_counter()
        for job in jobs:
            sched.submit(job)
        while sched.depth:
            sched.run_once()
        sync(bench.device)
        return time.perf_counter() - begin, jobs, sched.rounds

    p = len(prompts[0])
    gens = replayed_gens(bench, model, p, gen, batch)  # request i: the same schedule in every run of the cell
    try:
        # warm-up: one block at the timed run's pace, every graph bucket captured
        run(replayed_gens(bench, model, p, bench.gen(a.block), batch))
        reset_peak(bench.device)
        with counter.tally() as tally, counter.excluding(block_rounds, "prefill_blocks"):
            seconds, jobs, rounds = run(gens)
        failed = [j.request_id for j in jobs if j.status is not Status.FINISHED]
        if failed:
            raise RuntimeError(f"requests did not finish: {failed}")
    except Exception as exc:
        bench.error(case, where, exc)
        return
    tokens, own = batch * a.focus_gen, {"replayed": False}
    if bench.replay is not None:  # what each request's schedule unmasks in the rounds run
        tokens = replayed_tokens([g.schedule for g in gens if g.schedule], rounds)
        spans = answer_spans(p, gen.gen_length, generation_block(gen, model.config.block_size))
        own = bench.replay.columns(gen, batch, spans, start=p)
    speed = tokens / seconds
    caches = [e.result.cache for j in jobs for e in list(j.events.queue) if isinstance(e, Final)]
    if bench.replay is not None and focus is not None:
        own |= bench.replay.sparsity("focus", caches, model.config.num_layers)
    done = sum(c.get("rows_forwarded", 0) for c in caches)
    total = sum(c.get("rows_plain", 0) for c in caches)
    bench.add({"case": case, "policy": name, "method": "vanilla", "context_tokens": a.vanilla_context,
               "gen_length": a.focus_gen, "batch": batch, "tokens_per_s": speed, "round_ms": seconds / rounds * 1e3,
               "forwards_per_round": per_round(tally.forwards, rounds), "tpf": tpf_of(tokens / batch, tally.forwards),
               "speedup_vs_vanilla": None, "peak_gib": peak_gib(bench.device),
               "model": model.config.model_id, "rows_frac": done / total if total else None, "seconds": seconds,
               "forwards": tally.forwards, "rounds": rounds,
               "speedup_vs_plain_rounds": speedup(speed, plain_rounds) if focus is not None else None,
               **own})  # fmt: skip
    return speed
