"""``pdllm serve``'s flags: roles, model, engine, KV tier, router, prefill, decode, KV handoff and server
options. Every flag also reads ``PDLLM_<FLAG>`` from the environment (what the Kubernetes manifests set).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from pdllm.shared import settings, settings_flags
from pdllm.shared.app.handoff import add_handoff_arguments
from pdllm.shared.cli_args import Parser
from pdllm.shared.host_memory import AUTO_SHARE, parse_bytes
from pdllm.shared.kv_write_policy import DEFAULT_KV_WRITE_POLICY, KV_WRITE_POLICIES, check_kv_write_policy
from pdllm.shared.rpc.options import add_server_arguments, env_value

ROLES = ("router", "prefill", "decode", "all")
# The schema's engine-only settings (shared/settings.py) a worker takes as flags.
SERVE_ENGINE_SETTINGS = ("chunk_boundary",)


# --prefill-piece-tokens by role. With --role all, decode rounds wait for each piece, so pieces are small;
# a prefill worker of its own only needs a piece short enough to stop soon after its callers left, and
# pieces of 2048 cost it 20% of its throughput (benchmarks/results/prefill_piece_tokens.md, H100).
PIECE_TOKENS = {"all": 2048, "prefill": 16384}


def _env_default(flag: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
    return env_value(flag, convert, default, os.environ)


def piece_tokens(args: argparse.Namespace, role: str) -> int | None:
    """The chunk tokens per prefill forward for ``role`` ("all" or "prefill"); None: whole batches."""
    piece = args.prefill_piece_tokens
    return (PIECE_TOKENS[role] if piece is None else piece) or None


def _bytes(raw: str) -> int:
    try:
        return parse_bytes(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _device_bytes(raw: str) -> int:
    if raw.strip().lower() == "auto":  # "auto" sizes from host memory
        raise argparse.ArgumentTypeError("expected a size such as 16G (device memory has no 'auto')")
    return _bytes(raw)


def _env_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {raw!r}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pdllm serve",
        usage="%(prog)s [--role {router,prefill,decode,all}] [--port PORT] [--model DIR] [FLAG ...]",
        description="pdllm serve: run the router, a prefill worker, a decode worker, or all three in one "
        "process. Every flag also reads PDLLM_<FLAG> from the environment.",
    )
    m = p.add_argument_group("role and model")
    m.add_argument(
        "--role",
        choices=ROLES,
        default=_env_default("--role", "all"),
        help="what this process runs: the public router, a prefill or decode worker, or all three (one "
        "model shared by the two workers, the router on --port)",
    )
    m.add_argument(
        "--model",
        default=_env_default("--model", None),
        help="checkpoint directory (default: the shipped model); the router reads its tokenizer",
    )
    m.add_argument(
        "--device", default=_env_default("--device", "cpu"), help="workers' device: cpu, cuda, cuda:N"
    )
    m.add_argument(
        "--dtype",
        default=_env_default("--dtype", "float32"),
        choices=["float32", "bfloat16", "float16"],
        help="workers' weights and KV dtype",
    )
    add_server_arguments(p)
    r = p.add_argument_group("router")
    r.add_argument(
        "--discovery",
        default=_env_default("--discovery", "static"),
        choices=["static", "kubernetes"],
        help="how the router finds workers: the --prefill-workers / --decode-workers lists, or the "
        "endpoints of the --k8s-* services",
    )
    r.add_argument(
        "--prefill-workers",
        default=_env_default("--prefill-workers", ""),
        help="static discovery: comma-separated host:port of the prefill workers",
    )
    r.add_argument(
        "--decode-workers",
        default=_env_default("--decode-workers", ""),
        help="static discovery: comma-separated host:port of the decode workers",
    )
    r.add_argument(
        "--k8s-namespace",
        default=_env_default("--k8s-namespace", ""),
        help="kubernetes discovery: the workers' namespace (required there; the manifests set the pod's own)",
    )
    r.add_argument(
        "--k8s-prefill-service",
        default=_env_default("--k8s-prefill-service", ""),
        help="kubernetes discovery: the prefill workers' Service",
    )
    r.add_argument(
        "--k8s-decode-service",
        default=_env_default("--k8s-decode-service", ""),
        help="kubernetes discovery: the decode workers' Service",
    )
    r.add_argument(
        "--max-queue",
        type=int,
        default=_env_default("--max-queue", 256, int),
        help="requests the router holds at once; beyond it, RESOURCE_EXHAUSTED",
    )
    r.add_argument(
        "--model-name",
        default=_env_default("--model-name", ""),
        help="name clients use (default: the model dir)",
    )
    r.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=_env_default("--max-prompt-bytes", 4 << 20, int),
        help="largest context + question + instruction a request may send (UTF-8 bytes)",
    )
    pb = p.add_argument_group("prefill")
    pb.add_argument(
        "--prefill-batch-requests",
        type=int,
        default=_env_default("--prefill-batch-requests", 8, int),
        help="concurrent requests whose chunks share one batched prefill (1: no cross-request batching)",
    )
    pb.add_argument(
        "--prefill-batch-wait-ms",
        type=float,
        default=_env_default("--prefill-batch-wait-ms", 2.0, float),
        help="milliseconds the first request of a batch waits for company",
    )
    pb.add_argument(
        "--prefill-piece-tokens",
        type=int,
        default=_env_default("--prefill-piece-tokens", None, int),
        help="chunk prefill forwards hold at most this many padded chunk tokens (at least one chunk): a "
        "request whose caller has gone stops between them, and in --role all decode rounds run between them "
        f"(0: whole batches of --prefill-batch chunks; default {PIECE_TOKENS['all']} with --role all, "
        f"{PIECE_TOKENS['prefill']} with --role prefill)",
    )
    pb.add_argument(
        "--fused-prefill",
        action=argparse.BooleanOptionalAction,
        default=_env_default("--fused-prefill", False, _env_bool),
        help="--role all: a chunk prefill piece and the next decode round run as one forward (default: they "
        "take turns; fused measured 0.92x at 4 and 1.03x at 16 concurrent 16K requests on an H100)",
    )
    pb.add_argument(
        "--overlap-pieces",
        action=argparse.BooleanOptionalAction,
        default=_env_default("--overlap-pieces", False, _env_bool),
        help="--role all on CUDA: prefill pieces run on a low-priority stream that overlaps the decode rounds "
        "(default: pieces and rounds take turns)",
    )
    d = p.add_argument_group("decode")
    d.add_argument(
        "--max-active",
        type=int,
        default=_env_default("--max-active", 64, int),
        help="requests decoded together in each batched round",
    )
    d.add_argument(
        "--kv-pool-bytes",
        type=int,
        default=_env_default("--kv-pool-bytes", 0, int),
        help="decode KV pool size in bytes; requests beyond it wait (default 0: 40%% of free GPU memory "
        "after the model load on CUDA, 256 MiB on CPU)",
    )
    d.add_argument(
        "--max-waiting",
        type=int,
        default=_env_default("--max-waiting", 256, int),
        help="requests queued beyond --max-active; beyond it, RESOURCE_EXHAUSTED (the router tries another "
        "worker)",
    )
    d.add_argument(
        "--max-vanilla-tokens",
        type=int,
        default=_env_default("--max-vanilla-tokens", 32768, int),
        help="longest prompt a vanilla request may have (0: no limit); vanilla forwards the whole prompt "
        "every step, so a cancelled request holds the device until its current step ends",
    )
    d.add_argument(
        "--build-pieces",
        type=int,
        default=_env_default("--build-pieces", 0, int),
        help="run each new session's KV build between rounds in pieces of this many layers (0: whole "
        "builds on their own CUDA stream, overlapping the rounds)",
    )
    d.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=_env_default("--cuda-graph", None, _env_bool),
        help="replay batched decode rounds as CUDA graphs, one per padded shape bucket (default: on for "
        "CUDA devices: 1.44 vs 1.25 req/s at 16 x 16K on an H100, benchmarks/results/serving_notes.md)",
    )
    d.add_argument(
        "--layer-graphs",
        action=argparse.BooleanOptionalAction,
        default=_env_default("--layer-graphs", True, _env_bool),
        help="with --cuda-graph: rounds that run eagerly (a decode policy decides inside the forward) replay "
        "each layer's work around the attention as CUDA graphs (--no-layer-graphs: every op eager)",
    )
    k = p.add_argument_group("KV tier")
    k.add_argument(
        "--kv-url", default=_env_default("--kv-url", ""), help="redis://host:port/db (empty: CPU only)"
    )
    k.add_argument(
        "--kv-cpu-bytes",
        type=_bytes,
        default=_env_default("--kv-cpu-bytes", "auto"),
        help="in-process CPU tier of chunk KV, in front of Redis: bytes (suffixes K/M/G/T), 'auto' = "
        f"{AUTO_SHARE:.0%}% of the host's available memory at startup, 0: none",
    )
    k.add_argument(
        "--kv-gpu-bytes",
        type=_device_bytes,
        default=_env_default("--kv-gpu-bytes", "0"),
        help="device-resident LRU of hot chunk KV in front of the other tiers, in bytes (suffixes K/M/G/T; "
        "CUDA): a document that comes back is copied device to device into prefill; 0: none",
    )
    k.add_argument(
        "--kv-write-queue-bytes",
        type=int,
        default=_env_default("--kv-write-queue-bytes", 1 << 30, int),
        help="chunk-KV writes to the tier run on a background thread with at most this many bytes queued "
        "(more are dropped and counted); 0: write on the device thread, waiting for each write",
    )
    k.add_argument(
        "--kv-write-policy",
        choices=KV_WRITE_POLICIES,
        default=_env_default("--kv-write-policy", DEFAULT_KV_WRITE_POLICY, check_kv_write_policy),
        help="which chunk KV prefill writes to the tier once a request's top-K is known: 'all' computed "
        "chunks, the 'selected' top-K, or 'second-sight' (the top-K; every chunk once a request finds its "
        "document already stored), benchmarks/results/kv_write_policy.md",
    )
    add_handoff_arguments(p, _env_default)
    # Engine settings no request carries: flag, choices, help and PDLLM_<FLAG> from the schema; unset, the
    # checkpoint's pdllm.json decides (serve.py checks what was given).
    settings_flags.add_arguments(
        p.add_argument_group("engine (prefill and decode workers)"),
        settings.EngineOnlySettings,
        unset="the checkpoint's pdllm.json, else {default}",
        names=SERVE_ENGINE_SETTINGS,
    )
    # The router's decode policy for requests that name none (a request's DecodePolicyParams decide
    # otherwise); workers take the policy each request carries.
    settings_flags.add_arguments(
        p.add_argument_group("decode policy (router: the default of requests that name none)"),
        settings.DecodePolicySettings,
    )
    return p
