"""``pdllm demo``: start the all-in-one deployment and answer a question about a bundled 12K-token document.

Starts the all-in-one deployment (router + prefill worker + decode worker, in-process CPU KV tier) on
the shipped default model, asks it a question about a bundled ~12K-token document with a planted fact,
streams the answer and prints the trace (selected chunks, scores, per-phase timings), then shuts down.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pdllm.shared.cli_args import Parser
from pdllm.shared.model.loader import DEFAULT_MODEL_DIR
from pdllm.shared.rpc.trace_format import SCORE_DIRECTION

SHARED = Path(__file__).resolve().parents[1]  # pdllm/shared: the bundled data and tokenizer live there
DATA = SHARED / "data"
TOKENIZER_DIR = SHARED / "training" / "tokenizer"


def placeholder_model(out: Path) -> Path:
    """An untrained model in the shipped model's shape, for checkouts that do not ship weights yet."""
    from transformers import AutoTokenizer

    from pdllm.shared.model.config import ModelConfig
    from pdllm.shared.model.loader import save_checkpoint
    from pdllm.shared.model.transformer import DiffusionLM

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    config = ModelConfig(
        family="dream", vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_layers=8,
        num_heads=8, num_kv_heads=2, head_dim=32, attention_bias=True, shift_logits=True, tie_word_embeddings=True,
        max_position_embeddings=1024, mask_token_id=tok.mask_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, model_id="untrained-placeholder",
    )  # fmt: skip
    model = DiffusionLM(config)
    model.init_weights(0)
    return save_checkpoint(model, out, tok)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pdllm demo",
        description="pdllm demo: start the all-in-one deployment (router, prefill and decode worker) on the "
        "shipped model, ask it about a bundled 12K-token document with a planted fact, print the answer "
        "and the trace, and stop.",
    )
    i = p.add_argument_group("input")
    i.add_argument(
        "--document",
        type=Path,
        default=DATA / "demo_document.txt",
        help="UTF-8 text file to ask about (default: the bundled document)",
    )
    i.add_argument("--question", default=None, help="the question (default: the bundled document's)")
    m = p.add_argument_group("model and method")
    m.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    m.add_argument("--method", choices=["pdllm", "vanilla"], default="pdllm", help="decoding method")
    m.add_argument(
        "--chunk-size", type=int, default=None, help="context tokens per chunk (default: the checkpoint's)"
    )
    m.add_argument(
        "--top-k", type=int, default=None, help="chunks kept for decoding (default: the checkpoint's)"
    )
    m.add_argument("--gen-length", type=int, default=16, help="answer tokens to denoise, one step each")
    return p


def main(argv: list[str] | None = None) -> int:
    from pdllm.shared.app.serve import build_parser as serve_parser
    from pdllm.shared.app.serve import start
    from pdllm.shared.rpc.client import PdllmClient

    args = build_parser().parse_args(argv)
    bundled = json.loads((DATA / "demo_question.json").read_text())
    question = args.question or bundled["question"]
    context = args.document.read_text(encoding="utf-8")
    tmp = None
    model = args.model
    if model is None and not DEFAULT_MODEL_DIR.is_dir():
        tmp = tempfile.TemporaryDirectory(prefix="pdllm-demo-")
        model = str(placeholder_model(Path(tmp.name) / "untrained"))
        print(
            "WARNING: this checkout ships no trained model yet (shared/checkpoints/pdllm-needle);\n"
            "         running the full pipeline on an UNTRAINED placeholder: the answer will be noise.",
            file=sys.stderr,
        )
    serve_argv = ["--role", "all", "--port", "0", "--metrics-port", "-1"]
    deployment = start(serve_parser().parse_args(serve_argv + (["--model", model] if model else [])))
    try:
        print(f"all-in-one deployment serving on {deployment.address}", file=sys.stderr)
        print(f"document: {args.document.name} ({len(context)} characters)\nquestion: {question}")
        started = time.perf_counter()
        final = None
        with PdllmClient(deployment.address, timeout_s=600) as client:
            stream = client.generate_stream(
                context, question, method=args.method, chunk_size=args.chunk_size, top_k=args.top_k,
                gen_length=args.gen_length, steps=args.gen_length,
            )  # fmt: skip
            terminal = sys.stderr.isatty()
            for event in stream:
                if event.HasField("partial"):
                    p = event.partial
                    line = f"  step {p.step}/{p.total_steps}: {p.text!r:60.60}"
                    sys.stderr.write(f"\r\x1b[K{line}" if terminal else f"{line}\n")
                else:
                    final = event.final
        if terminal:
            sys.stderr.write("\n")
        assert final is not None
        t = final.trace
        print(f"answer: {final.text!r}")
        if args.question is None:
            verdict = "correct" if final.text.strip() == bundled["answer"] else "wrong"
            print(f"planted fact: {bundled['planted_fact'].strip()!r} -> {verdict}")
        print(f"method: {t.method}  prompt tokens: {t.prompt_tokens}  chunks: {t.num_chunks}")
        if t.method == "pdllm":
            print(f"selected chunks: {list(t.selected_chunk_ids)} {SCORE_DIRECTION}")
            print(f"kept context tokens: {t.kept_tokens}")
        tm = t.timings
        print(
            f"timings: prefill {tm.prefill_s:.2f}s score {tm.score_s:.2f}s select {tm.select_s:.3f}s "
            f"build {tm.build_s:.2f}s decode {tm.decode_s:.2f}s total {time.perf_counter() - started:.2f}s"
        )
    finally:
        deployment.stop()
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
