"""The ``pdllm`` command line: generate, train, eval, serve, ask, demo.

Every subcommand turns expected failures (bad arguments, missing files, unloadable checkpoints) into
one ``error: ...`` line and exit code 2; stack traces are for bugs only. Every flag has help, ``--help``
shows defaults in groups, and a mistyped flag is named (``shared/cli_args.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdllm.shared import settings, settings_flags
from pdllm.shared.cli_args import Parser

EXIT_USAGE = 2

# Subcommands whose implementation lives in another module: name -> (module, one-line description).
DELEGATED: dict[str, tuple[str, str]] = {
    "serve": (
        "pdllm.shared.app.serve",
        "run a router, a prefill worker, a decode worker, or all three in one process",
    ),
    "ask": ("pdllm.shared.rpc.ask", "ask a running server a question about a (long) context"),
    "demo": (
        "pdllm.shared.app.demo",
        "start the all-in-one deployment and answer a question about a bundled 12K-token document",
    ),
    "eval": ("pdllm.shared.app.eval", "long-context accuracy, vanilla vs pdllm, over length x depth"),
    "train": ("pdllm.shared.training.train", "train the small dLLM the project ships"),
}
GENERATE = "answer a question about a (long) context in this process, no server"

# A vanilla prompt longer than this on a CPU gets a step-time estimate before decoding starts: every
# vanilla step forwards the whole prompt.
VANILLA_NOTE_TOKENS = 4096
# The timed forward behind that estimate: at most this many tokens and this many FLOPs (a few seconds on a
# CPU; shorter forwards are dominated by per-operation costs on a busy machine and overestimate a step).
CALIBRATION_TOKENS = 4096
CALIBRATION_FLOPS = 2e11


def _build_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help=GENERATE,
        description=f"pdllm generate: {GENERATE}.",
        usage="%(prog)s (--context-file FILE | --context TEXT) --question TEXT [--method {vanilla,pdllm}] "
        "[FLAG ...]",
    )
    i = p.add_argument_group("input")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="UTF-8 text file holding the context")
    src.add_argument("--context", help="the context itself")
    i.add_argument("--question", required=True, help="the question to answer about the context")
    i.add_argument("--instruction", default=None, help="optional instruction before the context")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    m.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    m.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weights' dtype"
    )
    settings_flags.add_arguments(p.add_argument_group("method"), settings.MethodSettings, names=["method"])
    # Every setting of the schema (shared/settings.py) is a flag, with PDLLM_<FLAG> as its default.
    settings_flags.add_arguments(p.add_argument_group("generation"), settings.GenerationSettings)
    settings_flags.add_arguments(p.add_argument_group("decode policy"), settings.DecodePolicySettings)
    e = p.add_argument_group("pdllm method (chunking, scoring, selection)")
    names = [*list(settings.MethodSettings.model_fields)[1:], *settings.EngineOnlySettings.model_fields]
    settings_flags.add_arguments(
        e, settings.EngineSettings, unset="the checkpoint's pdllm.json, else {default}", names=names
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        action="store_true",
        help="print the response as one JSON object, in the fields of pdllm.v1.GenerateResponse "
        "(what `pdllm ask --json` prints)",
    )


def _read_context(args: argparse.Namespace) -> str:
    if args.context is not None:
        return args.context
    try:
        return args.context_file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ValueError(f"{args.context_file}: no such file") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{args.context_file}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def forward_flops(config: Any, tokens: int, logit_rows: int) -> float:
    """FLOPs of one forward over ``tokens`` positions: the projections and MLP (linear in ``tokens``),
    attention scores and values (quadratic) and ``logit_rows`` rows of the LM head."""
    h, heads, kv_heads, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    per_token = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * config.intermediate_size
    linear = 2.0 * tokens * config.num_layers * per_token
    attention = 4.0 * config.num_layers * tokens * tokens * heads * d
    return linear + attention + 2.0 * logit_rows * h * config.vocab_size


def vanilla_step_seconds(model: Any, prompt: list[int], gen_length: int) -> tuple[float, int]:
    """(estimated seconds of one vanilla step, tokens of the forward it was measured on): a forward of the
    prompt's first tokens is timed and scaled by :func:`forward_flops` to the whole prompt."""
    import torch

    config = model.config
    n = min(len(prompt), CALIBRATION_TOKENS)
    while n > 64 and forward_flops(config, n, n) > CALIBRATION_FLOPS:
        n //= 2
    device = next(model.parameters()).device
    ids = torch.tensor([prompt[:n]], device=device)
    times: list[float] = []
    with torch.no_grad():
        model(ids[:, : min(n, 256)])  # one-time costs
        # A busy machine adds noise: the fastest of at least 2 timed runs, more while they take less than
        # a second in all (at most 10).
        while len(times) < 2 or (sum(times) < 1.0 and len(times) < 10):
            began = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - began)
    seconds = min(times)
    whole = forward_flops(config, len(prompt) + gen_length, gen_length)
    return seconds * whole / forward_flops(config, n, n), n


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _vanilla_note(loaded: Any, prompt: list[int], gen: Any, device: str) -> None:
    """Before a long vanilla decode on a CPU: how long a step will take, and what the model card says
    about vanilla decoding beyond the training length."""
    if device != "cpu" or len(prompt) <= VANILLA_NOTE_TOKENS or loaded.config.block_size is not None:
        return  # (SDAR decodes over an exact cache: its steps do not forward the whole prompt)
    step, measured = vanilla_step_seconds(loaded.model, prompt, gen.gen_length)
    print(
        f"note: every vanilla step forwards the whole {len(prompt)}-token prompt; on this CPU a step should "
        f"take about {_duration(step)}, {gen.steps} steps about {_duration(step * gen.steps)} "
        f"(estimated from a timed {measured}-token forward; after the first step the progress bar shows the "
        "measured rate). --method pdllm forwards only the question and the answer.",
        file=sys.stderr,
    )
    train = loaded.serving.train_length
    if train and len(prompt) > 2 * train:
        from pdllm.shared.model.loader import DEFAULT_MODEL_DIR

        shipped = loaded.path.resolve() == DEFAULT_MODEL_DIR.resolve()
        card = " (its model card: needle exact match 0% at 16x, pdllm's 99.5%)" if shipped else ""
        print(
            f"note: {loaded.path.name} was trained on {train}-token contexts, {len(prompt) / train:.0f}x shorter "
            f"than this prompt; vanilla decoding loses accuracy beyond that length{card}. pdllm decodes over "
            "chunks that fit it.",
            file=sys.stderr,
        )


def cmd_generate(args: argparse.Namespace) -> int:
    from pdllm.shared.app.trace import generate_traced, response
    from pdllm.shared.model.loader import load_model
    from pdllm.shared.prompt import encode_prompt
    from pdllm.shared.rpc.trace_format import message_json, summary

    label = settings_flags.flag_label()
    gen = settings.generation_config(settings_flags.from_args(args, settings.GenerationSettings), label=label)
    policy = settings.decode_policy_config(
        settings_flags.from_args(args, settings.DecodePolicySettings), label=label
    )
    context = _read_context(args)
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    load_s = time.perf_counter() - t0
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.path}: no tokenizer files; `generate` needs text in and out")
    ids = encode_prompt(loaded.tokenizer, context, args.question, args.instruction)
    sel = None
    # SDAR: vanilla decodes block by block (decode_service/block_diffusion.py), pdllm by block diffusion over
    # the selected chunks (decode_service/sdar_decode.py).
    if args.method == "vanilla":
        from pdllm.decode_service.worker import DecodeWorker

        prompt = list(ids.vanilla(loaded.config.bos_token_id))
        _vanilla_note(loaded, prompt, gen, str(args.device))
        started = time.perf_counter()
        result = DecodeWorker(loaded.model).vanilla(prompt, gen, policy, progress=True)
    else:
        from pdllm.shared.app.engine import PrefillingEngine
        from pdllm.shared.config import EngineConfig

        # The checkpoint's recommended settings (pdllm.json), then the flags / PDLLM_* variables given.
        checkpoint = settings.engine_values(EngineConfig.from_settings(loaded.serving.engine))
        given = settings_flags.from_args(args, settings.EngineSettings)
        engine_cfg = settings.engine_config(checkpoint | given, label=label)
        engine = PrefillingEngine(loaded.model, loaded.tokenizer, engine_cfg)
        started = time.perf_counter()
        result, sel = generate_traced(engine, ids, gen, policy, progress=True)
    total_s = time.perf_counter() - started
    answer = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
    prompt_tokens = len(ids.instruction) + len(ids.context) + len(ids.query)
    out = response(
        args.method,
        loaded.path.name,
        answer,
        result,
        prompt_tokens,
        len(ids.context),
        loaded.config.eos_token_id,
        total_s,
        sel,
    )
    if args.json:
        print(json.dumps(message_json(out)))
        return 0
    print(answer)
    print(summary(out.trace, {"load_s": load_s}), file=sys.stderr)
    return 0


def _delegate(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                raise ValueError(f"this build of pdllm has no `{module}` yet") from exc
            raise
        return int(mod.main(argv) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pdllm", description="Prefill/decode-disaggregated inference for diffusion LMs on long contexts."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _build_generate_parser(sub)
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)  # parsed by the module's own parser
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_transformers()
    if argv and argv[0] in DELEGATED:
        runner = _delegate(DELEGATED[argv[0]][0])
        rest = argv[1:]
        return _guarded(lambda: runner(rest))
    try:
        parser = build_parser()
    except ValueError as exc:  # a PDLLM_<FLAG> variable that is not a valid value
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    return _guarded(lambda: cmd_generate(args))


def _quiet_transformers() -> None:
    """transformers warns about our Dream/LLaDA config.json when loading tokenizers; users can't act on it."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


def _guarded(fn: Callable[[], int]) -> int:
    from pdllm.shared.model.config import ModelConfigError
    from pdllm.shared.model.loader import CheckpointError

    try:
        return fn()
    except (ValueError, CheckpointError, ModelConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
