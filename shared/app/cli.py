"""The ``pdllm`` command line: generate, train, eval, serve, ask.

Every subcommand turns expected failures (bad arguments, missing files, unloadable checkpoints) into
one ``error: ...`` line and exit code 2; stack traces are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pdllm.shared import settings

EXIT_USAGE = 2

# Subcommands whose implementation lives in another module: name -> (module, help).
DELEGATED: dict[str, tuple[str, str]] = {
    "train": ("pdllm.shared.training.train", "train the small dLLM the project ships"),
    "eval": ("pdllm.shared.app.eval", "long-context accuracy: vanilla vs pdllm"),
    "serve": ("pdllm.shared.app.serve", "run a router / prefill / decode worker, or all in one"),
    "ask": ("pdllm.shared.rpc.ask", "ask a running server a long-context question"),
    "demo": (
        "pdllm.shared.app.demo",
        "all-in-one deployment answering a question about a bundled 12K-token document",
    ),
}


def _build_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="answer a question about a (long) context, in process")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="UTF-8 text file holding the context")
    src.add_argument("--context", help="the context itself")
    p.add_argument("--question", required=True)
    p.add_argument("--instruction", default=None, help="optional instruction before the context")
    settings.add_arguments(p, settings.MethodSettings, names=["method"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    # Every setting of the schema (shared/settings.py) is a flag, with PDLLM_<FLAG> as its default.
    settings.add_arguments(p.add_argument_group("generation"), settings.GenerationSettings)
    settings.add_arguments(p.add_argument_group("decode policy"), settings.DecodePolicySettings)
    m = p.add_argument_group("pdllm method")
    names = [*list(settings.MethodSettings.model_fields)[1:], *settings.EngineOnlySettings.model_fields]
    settings.add_arguments(
        m, settings.EngineSettings, unset="the checkpoint's pdllm.json, else {default}", names=names
    )
    m.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _read_context(args: argparse.Namespace) -> str:
    if args.context is not None:
        return args.context
    try:
        return args.context_file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ValueError(f"{args.context_file}: no such file") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{args.context_file}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def cmd_generate(args: argparse.Namespace) -> int:
    from pdllm.shared.model.loader import load_model
    from pdllm.shared.prompt import encode_prompt

    label = settings.flag_label()
    gen = settings.generation_config(settings.from_args(args, settings.GenerationSettings), label=label)
    policy = settings.decode_policy_config(
        settings.from_args(args, settings.DecodePolicySettings), label=label
    )
    context = _read_context(args)
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    # SDAR: vanilla decodes block by block (decode_service/block_diffusion.py), pdllm by block diffusion over
    # the selected chunks (decode_service/sdar_decode.py).
    load_s = time.perf_counter() - t0
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.path}: no tokenizer files; `generate` needs text in and out")
    ids = encode_prompt(loaded.tokenizer, context, args.question, args.instruction)
    timings: dict[str, float] = {"load": load_s}
    trace: dict | None = None
    if args.method == "vanilla":
        from pdllm.decode_service.worker import DecodeWorker

        prompt = ids.vanilla(loaded.config.bos_token_id)
        result = DecodeWorker(loaded.model).vanilla(list(prompt), gen, policy, progress=True)
        timings.update(result.timings)  # SDAR: the prompt's block-causal prefill
        timings["decode"] = result.decode_seconds
    else:
        from pdllm.shared.app.engine import PrefillingEngine
        from pdllm.shared.config import EngineConfig

        # The checkpoint's recommended settings (pdllm.json), then the flags / PDLLM_* variables given.
        checkpoint = settings.engine_values(EngineConfig.from_settings(loaded.serving.engine))
        given = settings.from_args(args, settings.EngineSettings)
        engine_cfg = settings.engine_config(checkpoint | given, label=label)
        engine = PrefillingEngine(loaded.model, loaded.tokenizer, engine_cfg)
        result, tr = engine.generate(
            ids.context,
            ids.query,
            gen,
            instruction_ids=ids.instruction or None,
            progress=True,
            decode_policy=policy,
        )
        trace = tr.to_dict()
        timings.update(trace.get("timings", {}))
    answer = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
    prompt_tokens = len(ids.instruction) + len(ids.context) + len(ids.query)
    if args.json:
        out = {"answer": answer, "method": args.method, "prompt_tokens": prompt_tokens, "timings": timings}
        out["decode_policy"] = {"policy": policy.name, **result.cache}
        if trace is not None:
            out["trace"] = trace
        print(json.dumps(out))
        return 0
    print(answer)
    print(f"\n[{args.method}] prompt tokens: {prompt_tokens}, steps: {result.steps}", file=sys.stderr)
    if result.cache:
        print("decode policy: " + json.dumps(result.cache), file=sys.stderr)
    print("timings: " + ", ".join(f"{k} {v:.3f}s" for k, v in timings.items()), file=sys.stderr)
    if trace is not None:
        print("trace: " + json.dumps({k: v for k, v in trace.items() if k != "timings"}), file=sys.stderr)
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
    parser = argparse.ArgumentParser(
        prog="pdllm", description="Prefill/decode-disaggregated inference for diffusion LMs on long contexts."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _build_generate_parser(sub)
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
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
