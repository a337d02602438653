"""Move one decode KV tensor between two processes: which transport, how fast?

    python benchmarks/kv_transport.py --tokens 4100,16400 --repeat 5 --out /tmp/kvt

The tensor is ``[layers, 2, kv_heads, tokens, head_dim]`` bf16 (Dream-7B defaults 28 x 2 x 4 x 128: 4100
tokens, the K=4 decode KV, is 235 MB). Rank 0 (prefill) holds it, rank 1 (decode) receives it into its own
buffer. Transports (each skipped, with the reason, where it cannot run):

- ``gloo``: ``ProcessGroupGloo`` send / recv of CPU tensors; ``nccl``: ``ProcessGroupNCCL`` send / recv,
  cuda:0 -> cuda:1 (2 GPUs). Both made without ``init_process_group``: ``TCPStore`` + ``PrefixStore``.
- ``mooncake-tcp``: Mooncake Transfer Engine (TCP, P2P handshake): rank 1 registers its CPU buffer, rank 0
  writes into it one-sided with ``transfer_sync_write`` (needs ``mooncake.engine`` importable).
- ``cuda-ipc``: both ranks on cuda:0; rank 0 puts the tensor on a ``torch.multiprocessing`` queue (a CUDA
  IPC handle), rank 1 opens it and copies it into its own buffer (timed: get, open, copy, as per request).

Each repeat: rank 1 zeroes its buffer, a store barrier, the timed move (on rank 1, to the data being in its
buffer, synchronized; on rank 0 for Mooncake's write), a barrier, rank 1 checks the bytes (``torch.equal``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRANSPORTS = ("gloo", "nccl", "mooncake-tcp", "cuda-ipc")
TIMEOUT = datetime.timedelta(seconds=300)


def log(msg: str) -> None:
    print(f"[kv_transport] {msg}", file=sys.stderr, flush=True)


def skip_reason(transport: str) -> str | None:
    """Why ``transport`` cannot run here, or None when it can."""
    if transport == "gloo":
        return None if dist.is_available() else "torch.distributed is not available"
    if transport == "nccl" and not (dist.is_available() and dist.is_nccl_available()):
        return "this torch has no NCCL"
    if transport == "nccl":
        return None if torch.cuda.device_count() >= 2 else f"needs 2 GPUs, found {torch.cuda.device_count()}"
    if transport == "cuda-ipc":
        return None if torch.cuda.is_available() else "no CUDA device"
    try:  # mooncake-tcp
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mooncake.engine does not import: {e}"
    return None


class Link:
    """One side of a transport; ``move`` sends (rank 0) or receives (rank 1) the whole buffer."""

    timer_rank = 1

    def __init__(self, transport: str, rank: int, store: dist.Store, host: str, ipc_q: Any) -> None:
        self.transport, self.rank, self.store, self.ipc_q = transport, rank, store, ipc_q
        cuda = {"nccl": rank, "cuda-ipc": 0}.get(transport)
        self.device = torch.device("cpu") if cuda is None else torch.device("cuda", cuda)
        if cuda is not None:
            torch.cuda.set_device(self.device)
        prefixed = dist.PrefixStore(f"pg/{transport}", store)
        if transport == "gloo":
            self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, 2, TIMEOUT)
        elif transport == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2)
        elif transport == "mooncake-tcp":
            from mooncake.engine import TransferEngine

            self.timer_rank = 0
            self.host, self.engine = host, TransferEngine()
            if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) failed")

    def bind(self, buf: torch.Tensor, key: str) -> None:
        """Per tensor setup: Mooncake registers both buffers and tells rank 0 where rank 1's is."""
        if self.transport == "mooncake-tcp" and self.engine.register_memory(buf.data_ptr(), buf.nbytes):
            raise RuntimeError(f"Mooncake register_memory of {buf.nbytes} bytes failed")
        if self.transport == "mooncake-tcp" and self.rank == 1:
            self.store.set(f"mc/{key}", json.dumps([self.engine.get_rpc_port(), buf.data_ptr()]))
        elif self.transport == "mooncake-tcp":
            port, self.remote = json.loads(self.store.get(f"mc/{key}"))
            self.target = f"{self.host}:{port}"

    def unbind(self, buf: torch.Tensor) -> None:
        if self.transport == "mooncake-tcp" and self.engine.unregister_memory(buf.data_ptr()):
            log(f"rank {self.rank}: Mooncake unregister_memory failed")

    def move(self, buf: torch.Tensor) -> None:
        if self.transport in ("gloo", "nccl"):
            op = self.pg.send if self.rank == 0 else self.pg.recv
            op([buf], 1 - self.rank, 0).wait()
        elif self.transport == "mooncake-tcp":
            if self.rank == 0:
                rc = self.engine.transfer_sync_write(self.target, buf.data_ptr(), self.remote, buf.nbytes)
                if rc != 0:
                    raise RuntimeError(f"Mooncake transfer_sync_write to {self.target} returned {rc}")
        elif self.rank == 0:  # cuda-ipc
            self.ipc_q.put(buf)
        else:
            buf.copy_(self.ipc_q.get())  # the received handle is dropped right after the copy
        self.sync()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def payload(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Seeded random bytes viewed as bf16: the same on both ranks, every bit pattern possible."""
    gen = torch.Generator(device=device).manual_seed(1234)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device, generator=gen)
    return bits.view(torch.bfloat16)


def worker(rank: int, transport: str, shapes: list[tuple[int, ...]], args: argparse.Namespace, port: int,
           results: Any, ipc_q: Any) -> None:  # fmt: skip
    store = dist.TCPStore(args.host, port, 2, rank == 0, TIMEOUT)

    def barrier(name: str) -> None:
        store.set(f"{name}/{rank}", "1")
        store.wait([f"{name}/0", f"{name}/1"])

    link = Link(transport, rank, store, args.host, ipc_q)
    for shape in shapes:
        tokens = shape[3]
        ref = payload(shape, link.device)
        buf = ref if rank == 0 else torch.empty_like(ref)
        link.bind(buf, str(tokens))
        times: list[float] = []
        for it in range(args.warmup + args.repeat):
            if rank == 1:
                buf.zero_()
                link.sync()
            barrier(f"pre/{tokens}/{it}")
            t0 = time.perf_counter()
            link.move(buf)
            dt = time.perf_counter() - t0
            barrier(f"post/{tokens}/{it}")
            if rank == 1 and not torch.equal(buf.view(torch.int16), ref.view(torch.int16)):
                raise RuntimeError(f"{transport}: received bytes differ from sent ones ({tokens} tokens)")
            if it >= args.warmup:
                times.append(dt)
        barrier(f"done/{tokens}")
        link.unbind(buf)
        if rank == link.timer_rank:
            results.put((tokens, buf.nbytes, statistics.median(times) * 1e3))
        del ref, buf
    barrier("exit")  # rank 0 hosts the store and (cuda-ipc) the shared memory: leave together
    if transport in ("gloo", "nccl"):
        getattr(link.pg, "shutdown", lambda: None)()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# KV transfer between two processes",
        "",
        f"{meta['device']}, {meta['date']}, torch {meta['torch']}, `{meta['command']}`",
        f"Tensor [{meta['layers']}, 2, {meta['kv_heads']}, tokens, {meta['head_dim']}] bf16; median of "
        f"{meta['repeat']} after {meta['warmup']} warm-up; every transfer checked with torch.equal.",
        "",
        "| transport | tokens | MB | ms | GB/s |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['transport']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | {r['ms']:.2f} | "
              f"{r['gb_per_s']:.2f} |" for r in rows] + [""]  # fmt: skip
    lines += [f"{k.capitalize()} {t}: {why}" for k in ("skipped", "failed") for t, why in meta[k].items()]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4100,16400", help="comma separated token counts")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma separated, of {TRANSPORTS}")
    p.add_argument("--host", default="127.0.0.1", help="loopback address for the store and Mooncake")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    wanted = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in TRANSPORTS]
    if unknown:
        p.error(f"unknown transport(s) {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    shapes = [(args.layers, 2, args.kv_heads, n, args.head_dim) for n in token_counts]

    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    skipped, failed = dict[str, str](), dict[str, str]()  # transport -> why
    for transport in wanted:
        why = skip_reason(transport)
        if why is not None:
            log(f"skip {transport}: {why}")
            skipped[transport] = why
            continue
        log(f"{transport}: tokens {token_counts}, warm-up {args.warmup}, repeat {args.repeat}")
        results, ipc_q = ctx.SimpleQueue(), ctx.Queue()
        try:
            mp.start_processes(worker, args=(transport, shapes, args, free_port(args.host), results, ipc_q),
                               nprocs=2, join=True, start_method="spawn")  # fmt: skip
        except Exception as e:  # one transport failing must not hide the others
            log(f"{transport} FAILED: {e}")
            failed[transport] = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        while not results.empty():
            tokens, nbytes, ms = results.get()
            rows.append({"tokens": tokens, "bytes": nbytes, "transport": transport, "ms": ms,
                         "gb_per_s": nbytes / ms / 1e6})  # fmt: skip
            log(f"{transport:>12} {tokens:>7} tokens {nbytes / 1e6:9.1f} MB {ms:9.2f} ms "
                f"{nbytes / ms / 1e6:8.2f} GB/s")  # fmt: skip

    meta = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "repeat": args.repeat,
        "warmup": args.warmup, "transports": wanted, "skipped": skipped, "failed": failed,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_transport.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    (args.out / "kv_transport.md").write_text(markdown(meta, rows))
    log(f"wrote {args.out / 'kv_transport.json'} and {args.out / 'kv_transport.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
