"""Handoff of a decode KV through pdllm's own path: ``KvSender`` (a prefill worker's gRPC ``KvTransfer``
service) in one process, ``KvReceiver`` (a decode worker's) in another, as serving runs it.

    python benchmarks/kv_handoff.py --tokens 4100,16400 --backends cuda-ipc,nccl,gloo --out benchmarks/results

The sender process offers a ``[layers, 2, kv_heads, tokens, head_dim]`` bf16 tensor on its GPU (Dream-7B
defaults: 4100 tokens = the K=4 full-mask decode KV, 235 MB); the receiver pulls it onto its GPU. One
row per (backend, tokens): median wall time of ``--repeat`` pulls after one warm-up, from ``start`` to
the KV being on the receiver's device (the gRPC ``Send`` call included), checked equal to the sent
bytes. ``--into pages`` (the default, what a decode worker does) lands it in consecutive pages of a paged
pool as the decode scheduler reserves them (``shared/kv_transfer/pages.py``); ``--into tensor`` in a new
tensor of its own (the path before the pool landing, and chunk-kv's). With 2 GPUs the sender is on GPU 0
and the receiver on GPU 1; with one, both share GPU 0 (NCCL cannot run there). Backends: ``cuda-ipc`` (the receiver maps the sender's memory, one host), ``nccl``,
``gloo`` (staged through host memory). Writes ``kv_handoff.json``
(``handoff`` rows ``{"tokens", "bytes", "transport", "ms", "gb_per_s"}``) and ``kv_handoff.md``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

from pdllm.decode_service.kv_receiver import KvReceiver, TransferState
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.kv_transfer import KvSender, SenderConfig, TransferConfig
from pdllm.shared.kv_transfer.pages import WIRE_PAGE, PageTarget, num_tiles, to_tiles
from pdllm.shared.rpc.server import ServerConfig, build_server, service_spec


def payload(tokens: int, args: argparse.Namespace, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (args.layers, 2, args.kv_heads, tokens, args.head_dim)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)


def sender_main(args: argparse.Namespace) -> None:
    """Child: serve KvTransfer; for each line ``<tokens> <seed>`` on stdin, offer that tensor, print it."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    config = TransferConfig(args.backend, timeout_s=60)
    sender = KvSender(SenderConfig(config, max_bytes=64 << 30), device)
    spec = service_spec(sender, workers_pb2_grpc.add_KvTransferServicer_to_server, "pdllm.v1.KvTransfer")
    server = build_server(ServerConfig(role="prefill"), [spec]).start()
    print("READY", server.address, flush=True)
    for line in sys.stdin:
        tokens, seed = (int(x) for x in line.split())
        kv = payload(tokens, args, device, seed)
        torch.cuda.synchronize() if device.type == "cuda" else None
        handoff = sender.offer(kv, wpb.KvHandoff(payload="decode-kv"))
        assert handoff is not None
        handoff.sender = server.address
        print("OFFER", base64.b64encode(handoff.SerializeToString()).decode(), flush=True)


def measure(args: argparse.Namespace, backend: str, gpus: int) -> list[dict]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"} if gpus else dict(os.environ)
    cmd = [sys.executable, __file__, "--role", "sender", "--backend", backend, *_shape_flags(args)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = child.stdout.readline().split()  # type: ignore[union-attr]
        assert ready and ready[0] == "READY", ready
        device = torch.device("cuda", 1 if gpus >= 2 else 0) if gpus else torch.device("cpu")
        receiver = KvReceiver(TransferConfig(backend, timeout_s=60), grpc.insecure_channel, device)
        rows = []
        for tokens in args.tokens:
            times = []
            target = None
            if args.into == "pages":  # one page in use before them, as in a pool serving other requests
                pool_shape = (args.layers, 2, num_tiles(tokens) + 1, args.kv_heads, WIRE_PAGE, args.head_dim)
                pool = torch.empty(pool_shape, dtype=torch.bfloat16, device=device)
                target = PageTarget(pool, tuple(range(1, num_tiles(tokens) + 1)))
            for rep in range(args.repeat + 1):
                child.stdin.write(f"{tokens} {rep}\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                line = child.stdout.readline().split()  # type: ignore[union-attr]
                handoff = wpb.KvHandoff.FromString(base64.b64decode(line[1]))
                start = time.perf_counter()
                transfer = receiver.start(handoff, target)
                transfer.wait()
                elapsed = time.perf_counter() - start
                if transfer.state is not TransferState.DONE:
                    raise RuntimeError(f"{backend} pull failed: {transfer.error}")
                sent = payload(tokens, args, device, rep)
                got = transfer.kv if target is None else target.kv[:, :, 1:]
                if not torch.equal(got, sent if target is None else to_tiles(sent)):
                    raise RuntimeError(f"{backend}: received bytes differ from the sent ones")
                if rep:  # the first pull opens the group (and NCCL's communicator): warm-up
                    times.append(elapsed)
                print(
                    f"[kv_handoff] {backend} {tokens} tok rep {rep}: {elapsed * 1e3:.1f} ms", file=sys.stderr
                )
            nbytes = handoff.nbytes
            ms = statistics.median(times) * 1e3
            rows.append({"tokens": tokens, "bytes": nbytes, "transport": f"pdllm-{backend}", "ms": round(ms, 2),
                         "gb_per_s": round(nbytes / ms / 1e6, 2)})  # fmt: skip
        receiver.close()
        return rows
    finally:
        child.kill()


def _shape_flags(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["bench", "sender"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    p.add_argument("--backends", default="cuda-ipc,nccl,gloo", help="comma list of cuda-ipc, nccl, gloo")
    p.add_argument("--tokens", default="4100,16400", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--into", choices=["pages", "tensor"], default="pages", help="where the receiver lands it")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.role == "sender":
        sender_main(args)
        return 0
    gpus = torch.cuda.device_count()
    rows, skipped = [], []
    for backend in args.backends.split(","):
        if backend not in ("gloo", "nccl", "cuda-ipc"):
            p.error(f"unknown backend {backend!r}; choose from cuda-ipc, nccl, gloo")
        if backend == "cuda-ipc" and not gpus:
            skipped.append({"transport": "pdllm-cuda-ipc", "reason": "no CUDA device"})
            continue
        if backend == "nccl" and gpus < 2:
            skipped.append({"transport": "pdllm-nccl", "reason": f"needs 2 GPUs, {gpus} visible"})
            continue
        rows += measure(args, backend, gpus)
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    meta = {"device": f"{gpus} x {device}" if gpus else "cpu", "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__, "skipped": skipped, "into": args.into,
            "placement": "sender GPU 0, receiver GPU 1" if gpus >= 2 else "sender and receiver share one device"}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_handoff.json").write_text(json.dumps({"meta": meta, "handoff": rows}, indent=1) + "\n")
    lines = [f"# KV handoff through KvSender/KvReceiver ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; {meta['placement']}; received into {meta['into']}; torch {meta['torch']}.", "",
             "| transport | tokens | MB | ms (median) | GB/s |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['transport']} | {r['tokens']} | {r['bytes'] / 1e6:.0f} | {r['ms']} | {r['gb_per_s']} |"
        for r in rows
    ]
    lines += [f"\nSkipped: {s['transport']} ({s['reason']})" for s in skipped]
    (args.out / "kv_handoff.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
