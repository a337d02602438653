"""The ``polestar-tpf`` case: tokens per forward on the shipped model under a confidence threshold."""

from __future__ import annotations

from typing import Any

from benchmarks.decode_cases.bench import ROOT, SHIPPED, Bench, per_round
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.generation.sampler import GenerationConfig
from tests.reference.vanilla import generate_vanilla

TPF_CELLS = (("needle", 1024, "vanilla"), ("needle", 1024, "pdllm"), ("needle", 16384, "pdllm"),
             ("long-answer", 1024, "vanilla"), ("long-answer", 1024, "pdllm"))  # fmt: skip
SMOKE_TPF_CELLS = (("needle", 1024, "vanilla"), ("needle", 1024, "pdllm"), ("long-answer", 1024, "vanilla"))


def answer_slots(raw: list[int], eos_id: int | None, mask_id: int) -> int:
    """Response slots a request produced: up to and including the first EOS (slots after it are EOS fill
    or never decoded), else every decoded slot."""
    if eos_id is not None and eos_id in raw:
        return raw.index(eos_id) + 1
    return sum(t != mask_id for t in raw)


def case_polestar_tpf(bench: Bench) -> None:
    from pdllm.shared.app.eval_settings import EvalSettings, eval_sample, exact_match
    from pdllm.shared.eval.long_answer import answer_gen_length
    from pdllm.shared.prompt import encode_prompt

    a, case = bench.args, "polestar-tpf"
    bench.use("shipped")
    loaded, counter = bench.shipped, bench.counter
    assert counter is not None
    tok, settings = loaded.tokenizer, EvalSettings()
    engines: dict[Any, PrefillingEngine] = {}
    plain: dict[tuple, list[int]] = {}
    eos, mask = loaded.config.eos_token_id, loaded.config.mask_token_id
    for task, length, method in SMOKE_TPF_CELLS if bench.run.smoke else TPF_CELLS:
        block = 4 if task == "needle" else 32
        for name in ("none", "dual-cache", "polestar", "polestar-per-layer"):
            where = {"task": task, "context_tokens": length, "method": method, "policy": name}
            if bench.left() <= 0:
                bench.skip(case, where, "time budget spent")
                continue
            steps = tokens = correct = same = compared = forwards = recomputed = recomputable = 0
            seconds = 0.0
            try:
                for i, depth in enumerate(a.tpf_depths):
                    sample = eval_sample(task, length, depth, 7000 + i, tok)
                    n = 8 if task == "needle" else answer_gen_length(tok, sample, block)
                    gen = GenerationConfig(gen_length=n, steps=n, block_length=block, threshold=a.threshold)
                    ids, policy = encode_prompt(tok, sample.context, sample.question), _policy(name)
                    with counter.tally() as tally:
                        if method == "vanilla":
                            prompt = ids.vanilla(loaded.config.bos_token_id)
                            result = generate_vanilla(loaded.model, prompt, gen, policy=policy)
                        else:
                            cfg = settings.engine_config(loaded, 1024, len(ids.query), n)
                            engine = engines.setdefault(cfg, PrefillingEngine(loaded.model, tok, cfg))
                            with counter.excluding(engine, "prefill", "build"):
                                result, _ = engine.generate(ids.context, ids.query, gen, decode_policy=policy)
                    steps, forwards = steps + result.steps, forwards + tally.forwards
                    tokens += answer_slots(result.raw_tokens, eos, mask)
                    if result.cache.get("updates"):  # rows an update could recompute: cached rows x layers
                        local = (len(prompt) if method == "vanilla" else len(ids.query)) + n
                        cached = local - block - int(loaded.config.shift_logits)
                        recomputed += result.cache["rows_recomputed"]
                        recomputable += result.cache["updates"] * loaded.config.num_layers * cached
                    seconds += result.decode_seconds
                    text = tok.decode(result.token_ids, skip_special_tokens=True)
                    correct += task == "needle" and exact_match(text, sample.answer)
                    ref = plain.setdefault((task, length, method, i), result.raw_tokens)
                    same += sum(x == y for x, y in zip(ref, result.raw_tokens, strict=True))
                    compared += len(ref)
            except Exception as exc:
                bench.error(case, where, exc)
                continue
            k = len(a.tpf_depths)
            bench.add({"case": case, "policy": name, "method": method, "context_tokens": length, "batch": 1,
                       "tokens_per_s": tokens / seconds if seconds else None,
                       "round_ms": seconds / steps * 1e3 if steps else None,
                       "forwards_per_round": per_round(forwards, steps), "tpf": tokens / steps if steps else None,
                       "peak_gib": None, "task": task, "block": block, "threshold": a.threshold, "samples": k,
                       "forwards": steps, "forwards_counted": forwards, "tokens": tokens,
                       "accuracy": correct / k if task == "needle" else None,
                       "agreement": same / compared if compared else None,
                       "recomputed_frac": recomputed / recomputable if recomputable else None})  # fmt: skip
    bench.meta(case)["setup"] = (
        f"shipped model `{SHIPPED.relative_to(ROOT)}` on {bench.device.type}, threshold {a.threshold}, depths "
        f"{a.tpf_depths}; forwards = denoising steps (one forward each; forwards_per_round checks it by "
        "counting); tokens = answer slots up to and including the first EOS; TPF = tokens / forwards; "
        "agreement: raw answer slots equal to the run without a policy; recomputed_frac: cached rows a "
        "Polestar update recomputed, over every layer of every update (polestar-per-layer: "
        "--polestar-recompute per-layer)."
    )


def _policy(name: str) -> DecodePolicyConfig:
    if name == "polestar-per-layer":
        return DecodePolicyConfig("polestar", polestar={"polestar_recompute": "per-layer"})
    return DecodePolicyConfig(name)
