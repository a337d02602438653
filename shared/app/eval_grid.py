"""``pdllm eval``'s grid runner: every (task, length, depth) cell's samples decoded by each method, scored,
and pooled into one row per method and cell (accuracy, token accuracy, agreement, TPF with the tokens and
forwards it pools); plus :func:`make_decoder`, one decode at a time for callers outside the grid.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app.eval_batch import BatchDecoder, Decoded, Item
from pdllm.shared.app.eval_settings import AnySample, EvalSettings, eval_sample, exact_match, generation
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.infilling import InfillSample, score_infill
from pdllm.shared.eval.long_answer import LongAnswerSample, score_passage, token_agreement
from pdllm.shared.eval.tpf import answer_tokens, tpf
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.generation.schedule import sample_record
from pdllm.shared.model.loader import LoadedModel
from pdllm.shared.rpc.trace_format import message_json

# (sample, generation settings, decode policy) -> answer token ids, trimmed at EOS.
Decoder = Callable[[AnySample, GenerationConfig, DecodePolicyConfig], list[int]]


def make_decoder(loaded: LoadedModel, method: str, settings: EvalSettings, train_length: int) -> Decoder:
    """A function (sample, generation, policy) -> answer token ids for ``method`` on ``loaded``, one
    decode at a time (``eval_batch.py`` decodes several together)."""
    batch = BatchDecoder(loaded, method, settings, train_length)

    def decode(sample: AnySample, gen: GenerationConfig, policy: DecodePolicyConfig) -> list[int]:
        (out,) = batch.decode([Item(sample, gen, policy)])
        return out.result.token_ids

    return decode


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_grid(
    loaded: LoadedModel,
    methods: list[str],
    tasks: list[str],
    lengths: list[int],
    depths: list[float],
    samples: int,
    settings: EvalSettings,
    train_length: int,
    progress: bool = True,
    on_cell: Callable[[list[dict]], None] | None = None,
    agreement: bool = False,
    on_trace: Callable[[dict], None] | None = None,
    on_schedule: Callable[[dict], None] | None = None,
    eval_batch: int = 1,
) -> list[dict]:
    """Rows for every cell; ``on_cell(rows so far)`` runs after each cell so long runs keep partial results.
    ``agreement``: also decode with policy ``none`` and report the share of tokens both decodings share.
    ``on_trace``: called with each sample's record (cell, expected answer, response with its trace).
    Each row carries the settings' ``threshold`` and the cell's ``tpf`` (``shared/eval/tpf.py``): its
    samples' answer tokens (up to and including the first EOS) over their decodes' steps, both summed
    (``tokens``, ``forwards``); the agreement reference decodes are not counted. ``on_schedule``: called
    with each sample's unmask schedule record (``schedule.sample_record``). ``eval_batch``: a cell's decodes
    (agreement references included) denoised that many at a time in the same rounds (``eval_batch.py``;
    the rows do not depend on it)."""
    if eval_batch <= 0:
        raise ValueError(f"--eval-batch must be positive (got {eval_batch})")
    tok = loaded.tokenizer
    eos, mask = loaded.config.eos_token_id, loaded.config.mask_token_id
    worker = DecodeWorker(loaded.model)  # one pool and round forward for every method's decodes
    traced = on_trace is not None
    decoders = {m: BatchDecoder(loaded, m, settings, train_length, traced, worker) for m in methods}
    policy = settings.decode_policy
    twice = agreement and policy.name != "none"  # under none the reference is the decoding itself
    rows: list[dict] = []
    total = len(methods) * len(tasks) * len(lengths) * len(depths) * samples * (2 if twice else 1)
    with tqdm(total=total, disable=not progress, desc="eval", unit="decode", file=sys.stderr) as bar:
        for task in tasks:
            for length in lengths:
                for depth in depths:
                    cell = [eval_sample(task, length, depth, seed, tok) for seed in range(samples)]
                    for method in methods:
                        start = time.perf_counter()
                        exact: list[float] = []
                        token_acc: list[float] = []
                        agree: list[float] = []
                        tokens = forwards = 0
                        items: list[Item] = []
                        for seed, s in enumerate(cell):  # each sample's decode, then its reference
                            gen = generation(settings, tok, s)
                            label = f"{task} length={length} depth={depth} seed={seed}"
                            items.append(Item(s, gen, policy, f"{label} policy={policy.name}"))
                            if twice:
                                items.append(Item(s, gen, DecodePolicyConfig(), f"{label} policy=none"))
                        decoded: list[Decoded] = []
                        for i in range(0, len(items), eval_batch):
                            decoded += decoders[method].decode(items[i : i + eval_batch])
                            bar.update(len(items[i : i + eval_batch]))
                        per = 2 if twice else 1
                        for seed, s in enumerate(cell):
                            gen = items[seed * per].gen
                            out = decoded[seed * per]
                            result = out.result
                            ids = result.token_ids
                            produced = answer_tokens(result.raw_tokens, eos, mask)
                            tokens += produced
                            forwards += result.steps  # its own steps, however many shared its rounds
                            if on_schedule is not None:
                                where = {"method": method, "decode_policy": policy.name}
                                where |= {"threshold": settings.threshold, "task": task}
                                where |= {"context_length": length, "depth": depth, "seed": seed}
                                record = sample_record(
                                    where,
                                    result.unmasked,
                                    gen.gen_length,
                                    gen.block,
                                    produced,
                                    result.cache,
                                    loaded.config.num_layers,
                                )
                                on_schedule(record)
                            text = tok.decode(ids, skip_special_tokens=True)
                            if isinstance(s, LongAnswerSample):
                                score = score_passage(tok, text, s.answer)
                                exact.append(score.exact)
                                token_acc.append(score.token_accuracy)
                            elif isinstance(s, InfillSample):
                                score = score_infill(ids, s.answer_ids)
                                exact.append(score.exact)
                                token_acc.append(score.token_accuracy)
                            else:
                                exact.append(exact_match(text, s.answer))
                            if on_trace is not None and out.response is not None:
                                record = {
                                    "task": task,
                                    "context_length": length,
                                    "depth": depth,
                                    "seed": seed,
                                    "expected": s.answer,
                                    "exact": bool(exact[-1]),
                                    "response": message_json(out.response),
                                }
                                if settings.threshold is not None:  # one-token-per-step records: as ever
                                    record["threshold"] = settings.threshold
                                on_trace(record)
                            if twice:
                                ref = decoded[seed * per + 1].result.token_ids
                                agree.append(token_agreement(ids, ref))
                            elif agreement:
                                agree.append(1.0)
                        row = {
                            "method": method,
                            "decode_policy": policy.name,
                            "threshold": settings.threshold,
                            "task": task,
                            "context_length": length,
                            "depth": depth,
                            "accuracy": _mean(exact),
                            "tpf": None if (v := tpf(tokens, forwards)) is None else round(v, 4),
                            "tokens": tokens,
                            "forwards": forwards,
                            "samples": samples,
                            "seconds": round(time.perf_counter() - start, 3),
                        }
                        if token_acc:
                            row["token_accuracy"] = round(_mean(token_acc), 4)
                        if agree:
                            row["agreement"] = round(_mean(agree), 4)
                        rows.append(row)
                    bar.set_postfix_str(
                        " ".join(
                            f"{r['method']}={r['accuracy']:.2f} tpf={r['tpf'] or 0:.2f}"
                            for r in rows[-len(methods) :]
                        )
                    )
                    if on_cell is not None:
                        on_cell(rows)
    return rows
