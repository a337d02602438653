"""``pdllm serve``: run the router, a prefill worker, a decode worker, or all three in one process.

``--role all`` is the one-machine deployment: one model shared by an in-process prefill worker and
decode worker on private loopback ports, and the router on ``--port`` routing to them. The KV tier is
an in-process CPU store, with Redis behind it when ``--kv-url redis://...`` is given. Every flag also
reads ``PDLLM_<FLAG>`` from the environment (what the Kubernetes manifests set).

SDAR (block-diffusion) checkpoints serve too: the decode worker decodes each of their requests by exact
block diffusion (``decode_service/server.py``), plain or under FOCUS; ``--cuda-graph``, a ``--decode-policy``
other than none and focus and the engine defaults it cannot run (chunk-only, top-B) are refused at startup,
with one line naming the flag. ``--decode-policy focus`` runs on SDAR only: a Dream/LLaDA checkpoint refuses
it at startup the same way.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from pdllm.shared import settings, settings_flags
from pdllm.shared.app.handoff import make_receiver, make_sender
from pdllm.shared.app.serve_args import build_parser, piece_tokens
from pdllm.shared.rpc.channels import worker_channel_factory
from pdllm.shared.rpc.options import server_config_from_args
from pdllm.shared.rpc.server import RpcServer, ServerConfig, build_server, check_port, service_spec

_log = logging.getLogger("pdllm.serve")


@dataclass
class Deployment:
    """What ``serve`` started; ``servers[0]`` is the public one."""

    servers: list[RpcServer]
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.servers[0].address

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        for close in self.closers:
            close()


def _kv_store(args: argparse.Namespace, model_config: Any, dtype: str) -> Any:
    from pdllm.shared.kv_tier import CPUStoreConfig, KVMeta, KVTierConfig, RedisStoreConfig, build_kv_store
    from pdllm.shared.kv_tier.writer import BackgroundKVWriter, KVWriterConfig
    from pdllm.shared.model.loader import DTYPES

    if args.kv_url and not args.kv_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--kv-url must be a redis:// URL, got {args.kv_url!r}")
    if args.kv_write_queue_bytes < 0:
        raise ValueError(f"--kv-write-queue-bytes must be >= 0, got {args.kv_write_queue_bytes}")
    meta = KVMeta.from_model_config(model_config, DTYPES[dtype])
    background = args.kv_write_queue_bytes > 0
    # Behind the writer every value put is the writer's own host copy, so the CPU tier need not copy again.
    cpu = CPUStoreConfig(args.kv_cpu_bytes, copy_on_put=not background) if args.kv_cpu_bytes > 0 else None
    store = build_kv_store(
        KVTierConfig(cpu=cpu, redis=RedisStoreConfig(args.kv_url) if args.kv_url else None), meta
    )
    if background:
        store = BackgroundKVWriter(store, KVWriterConfig(max_pending_bytes=args.kv_write_queue_bytes))
    if args.kv_gpu_bytes > 0:
        import torch

        from pdllm.shared.kv_tier.device_cache import DeviceChunkCache

        store = DeviceChunkCache(store, args.kv_gpu_bytes, torch.device(args.device))
    return store


def _engine(args: argparse.Namespace) -> Any:
    from pdllm.decode_service import sdar_decode
    from pdllm.shared.app.engine import PrefillingEngine
    from pdllm.shared.config import EngineConfig
    from pdllm.shared.model.loader import load_model, read_config, resolve_model_dir

    if args.cuda_graph and read_config(resolve_model_dir(args.model)).family == "sdar":  # config.json only
        raise ValueError(
            "--cuda-graph is not supported on SDAR (block-diffusion) checkpoints: the decode worker steps "
            "each SDAR request's block diffusion alone and eagerly (leave --cuda-graph unset)"
        )
    if args.cuda_graph and not str(args.device).startswith("cuda"):  # before a long model load
        raise ValueError(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    if args.kv_gpu_bytes and not str(args.device).startswith("cuda"):
        raise ValueError(f"--kv-gpu-bytes needs a CUDA device, got --device {args.device}")
    # Worker-level engine defaults (the checkpoint's pdllm.json, then flags); a request's MethodParams
    # override the fields it sets. The flags are checked first, named as given (a flag or its PDLLM_ variable).
    given = settings_flags.from_args(args, settings.EngineOnlySettings)
    settings.validate(settings.EngineOnlySettings, given, label=settings_flags.flag_label())
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    policy = _policy_defaults(args).get("decode_policy") or "none"
    if loaded.config.block_size is not None and policy not in sdar_decode.POLICIES:  # the worker's refusal
        raise ValueError(
            f"--decode-policy {policy} is not supported on SDAR (block-diffusion) checkpoints: the decode "
            "worker decodes them by block diffusion, plain or under FOCUS (--decode-policy none or focus)"
        )
    if loaded.config.block_size is None and policy == "focus":  # the worker's refusal (sessions.py)
        raise ValueError(
            "--decode-policy focus runs on block-diffusion (SDAR) checkpoints only; on Dream/LLaDA it "
            "measured no gain over plain decoding"
        )
    config = EngineConfig.from_settings(loaded.serving.engine, **given)
    store = _kv_store(args, loaded.config, args.dtype)
    engine = PrefillingEngine(
        loaded.model, loaded.tokenizer, config, store=store, kv_write_policy=args.kv_write_policy
    )
    engine.prefill_worker.sentence_ends()  # fail at startup, not on the first request, without sentence ends
    return engine, loaded


def start_prefill(
    args: argparse.Namespace,
    config: ServerConfig,
    worker: Any,
    run_batch: Callable | None = None,
    decode_worker: Any = None,
) -> tuple[RpcServer, Callable]:
    """``worker``: the engine's :class:`~pdllm.prefill_service.worker.PrefillWorker`; ``run_batch``: how a
    batch runs (default: on the prefill worker's own thread); ``decode_worker``: when given, the worker
    also serves KV handoffs (``KvTransfer``), building decode KV with it."""
    from pdllm.prefill_service.batching import BatchingConfig
    from pdllm.prefill_service.server import PrefillServicer
    from pdllm.protos.pdllm.v1 import workers_pb2_grpc

    registry = CollectorRegistry()
    batching = BatchingConfig(
        max_requests=args.prefill_batch_requests, wait_s=args.prefill_batch_wait_ms / 1e3
    )
    sender = None
    specs = []
    if decode_worker is not None:
        # The decode worker's own build: same KV. None on SDAR: that KV is not block-causal, and an SDAR
        # decode worker rebuilds its block-causal prefix itself (decode_service/sdar_decode.py).
        sdar = decode_worker.model.config.block_size is not None
        worker.decode_kv_build = None if sdar else decode_worker.build_selected
        sender = make_sender(args, worker.device, registry)
        specs.append(
            service_spec(sender, workers_pb2_grpc.add_KvTransferServicer_to_server, "pdllm.v1.KvTransfer")
        )
    # Its own thread (no run_batch): forwards of at most --prefill-piece-tokens, so a batch whose callers
    # have all gone (deadline, cancel) stops within one such forward.
    piece = piece_tokens(args, "prefill")
    servicer = PrefillServicer(worker, registry, batching, run_batch, sender, piece)
    _register_kv_metrics(worker.store, registry)
    specs.insert(
        0, service_spec(servicer, workers_pb2_grpc.add_PrefillServicer_to_server, "pdllm.v1.Prefill")
    )

    def close() -> None:
        servicer.batcher.close()
        if sender is not None:
            sender.close()

    return build_server(config, specs, registry).start(), close


def _register_kv_metrics(store: Any, registry: CollectorRegistry) -> None:
    from pdllm.shared.kv_tier.stats import register_kv_metrics

    if store is None:  # a worker without a KV tier
        return
    tiers = getattr(store, "tiers", None) or [store]
    if store not in tiers:  # a background writer in front of the tiers: its drops and queue too
        tiers = [*tiers, store]
    register_kv_metrics({getattr(t, "name", f"tier{i}"): t for i, t in enumerate(tiers)}, registry)


def _pool_bytes(flag: int, device: Any) -> int:
    if flag > 0:
        return flag
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(0.4 * free)
    return 256 << 20


def round_forward(args: argparse.Namespace, model: Any, pool: Any) -> Any:
    """How the decode worker runs a batched round: the split-S kernel on CUDA (as CUDA graphs with
    ``--cuda-graph``, the default there except for SDAR, whose requests never join a round), its torch
    reference elsewhere."""
    from pdllm.decode_service.round_graphs import GraphedRoundForward
    from pdllm.decode_service.rounds import EagerRoundForward
    from pdllm.kernels import HAS_TRITON

    cuda = pool.kv.device.type == "cuda"
    kernel = "triton" if cuda and HAS_TRITON else "torch"
    sdar = model.config.block_size is not None  # SDAR's rounds: graphed only when --cuda-graph asks
    if args.cuda_graph or (args.cuda_graph is None and cuda and kernel == "triton" and not sdar):
        return GraphedRoundForward(model, pool, kernel, capture=True, layer_graphs=args.layer_graphs)
    return EagerRoundForward(model, pool, kernel)


def start_decode(
    args: argparse.Namespace, config: ServerConfig, worker: Any, kv_metrics: bool = True, handoff: bool = True
) -> tuple[RpcServer, Any, Callable[[], None]]:
    """``worker``: the engine's :class:`~pdllm.decode_service.worker.DecodeWorker`; ``kv_metrics``: export
    its KV tier's metrics (False when another server of the process exports the same tier); ``handoff``:
    pull KV that prefill workers hand off. Returns the server, its
    :class:`~pdllm.decode_service.scheduler.DecodeScheduler` and what stops them."""
    from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig
    from pdllm.decode_service.scheduler import DecodeScheduler, SchedulerConfig
    from pdllm.decode_service.server import DecodeServicer
    from pdllm.protos.pdllm.v1 import workers_pb2_grpc

    registry = CollectorRegistry()
    pool = DecodeKVPool.for_model(worker.model, KVPoolConfig(_pool_bytes(args.kv_pool_bytes, worker.device)))
    forward = round_forward(args, worker.model, pool)
    scheduling = SchedulerConfig(args.max_active, args.max_waiting, args.overlap_pieces, args.build_pieces)
    scheduler = DecodeScheduler(worker.model, pool, forward, scheduling, registry)
    receiver = None
    if handoff:
        receiver = make_receiver(args, worker.device, worker_channel_factory(config), registry)
    servicer = DecodeServicer(worker, scheduler, args.max_vanilla_tokens, receiver)
    if kv_metrics:
        _register_kv_metrics(worker.store, registry)
    spec = service_spec(servicer, workers_pb2_grpc.add_DecodeServicer_to_server, "pdllm.v1.Decode")

    def close() -> None:
        scheduler.close()
        if receiver is not None:
            receiver.close()

    return build_server(config, [spec], registry).start(), scheduler, close


def start_router(
    args: argparse.Namespace,
    config: ServerConfig,
    tokenizer: Any,
    workers: ServerConfig | None = None,
    also_export: Sequence[CollectorRegistry] = (),
) -> tuple[RpcServer, Callable]:
    """``workers``: how the workers are reached (TLS, token); default: like the router itself.
    ``also_export``: registries the router's metrics endpoint serves beside its own."""
    from pdllm.protos.pdllm.v1 import generation_pb2_grpc
    from pdllm.router.discovery import discovery_from_flags
    from pdllm.router.server import Pools, RouterConfig, RouterServicer
    from pdllm.router.worker_pool import HealthCheckConfig, WorkerPool

    channel_factory = worker_channel_factory(workers or config)
    pools = {
        role: WorkerPool(role, HealthCheckConfig(interval_s=2.0), channel_factory)
        for role in ("prefill", "decode")
    }
    source = discovery_from_flags(args.discovery, vars(args))
    source.subscribe(lambda role, addresses: pools[role].set_members(addresses))
    source.start()
    for pool in pools.values():
        pool.check_once()  # workers already up (all-in-one, a restart) are routable before "serving"
        pool.start()
    view = Pools(healthy=lambda role: pools[role].healthy(), channel=lambda a: _any_channel(pools, a))
    view.on_failure(lambda role, address: pools[role].report_failure(address))
    from pdllm.shared.model.loader import read_serving_defaults, resolve_model_dir
    from pdllm.shared.rpc.validation import RequestDefaults, ValidationLimits

    model_dir = resolve_model_dir(args.model)
    name = args.model_name or model_dir.name
    limits = ValidationLimits(models=(name,), max_prompt_bytes=args.max_prompt_bytes)
    engine = read_serving_defaults(model_dir).engine
    defaults = RequestDefaults.for_engine(engine, model=name, **_policy_defaults(args))
    # all-in-one: no worker names
    routing = RouterConfig(max_queue=args.max_queue, name_workers=workers is None, build_on=args.build_on)
    servicer = RouterServicer(tokenizer, view, routing, limits, defaults)
    spec = service_spec(servicer, generation_pb2_grpc.add_GenerationServicer_to_server, "pdllm.v1.Generation")
    server = build_server(config, [spec]).start(also_export)

    def close() -> None:
        source.stop()
        for pool in pools.values():
            pool.stop()

    return server, close


def _any_channel(pools: dict, address: str) -> grpc.Channel:
    for pool in pools.values():
        try:
            return pool.channel(address)
        except KeyError:
            continue
    raise KeyError(address)


def _policy_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The router's decode policy for requests that name none (checked before any model load)."""
    given = settings_flags.from_args(args, settings.DecodePolicySettings)
    return dict(settings.validate(settings.DecodePolicySettings, given, label=settings_flags.flag_label()))


def start(args: argparse.Namespace) -> Deployment:
    """Start what ``args.role`` asks for; returns once every server is serving."""
    _policy_defaults(args)
    config = server_config_from_args(args, args.role if args.role != "all" else "router")
    check_port(config.host, config.port)  # a taken --port fails before a long model load
    if args.role == "router":
        from pdllm.shared.model.loader import load_tokenizer, resolve_model_dir

        server, close = start_router(args, config, load_tokenizer(resolve_model_dir(args.model)))
        return Deployment([server], [close])
    engine, loaded = _engine(args)
    close_store = engine.store.close  # last: writes the KV the workers queued before they stopped
    if args.role == "prefill":
        server, close = start_prefill(args, config, engine.prefill_worker, decode_worker=engine.decode_worker)
        return Deployment([server], [close, close_store])
    if args.role == "decode":
        server, _, close = start_decode(args, config, engine.decode_worker)
        return Deployment([server], [close, close_store])
    # all: private workers on loopback, no metrics endpoints of their own
    internal = replace(config, host="127.0.0.1", port=0, metrics_port=None, tls=None)
    prefill_config, decode_config = replace(internal, role="prefill"), replace(internal, role="decode")
    # the prefill server exports the KV tier both workers share
    decode, scheduler, close_decode = start_decode(
        args, decode_config, engine.decode_worker, kv_metrics=False, handoff=False
    )
    # One device thread: the prefill worker's batches run on the decode scheduler's thread, in pieces of
    # at most --prefill-piece-tokens between decode rounds (no other thread launches work during a capture).
    steps = engine.prefill_worker.prefill_many_steps
    piece = piece_tokens(args, "all")
    run_batch = lambda jobs: scheduler.run_between_rounds(steps(jobs, piece, args.fused_prefill))  # noqa: E731
    prefill, close_prefill = start_prefill(args, prefill_config, engine.prefill_worker, run_batch)
    args = argparse.Namespace(
        **{
            **vars(args),
            "discovery": "static",
            "prefill_workers": prefill.address,
            "decode_workers": decode.address,
            "build_on": "decode",  # one device: nothing to hand off
        }
    )
    # One public metrics endpoint for the three servers (the workers' own have no port), the router's:
    # router, prefill, decode and KV-tier metrics, the servers' pdllm_rpc_* told apart by their role label.
    workers_metrics = [prefill.registry, decode.registry]
    router, close_router = start_router(
        args, config, loaded.tokenizer, workers=internal, also_export=workers_metrics
    )
    return Deployment([router, prefill, decode], [close_router, close_prefill, close_decode, close_store])


def main(argv: list[str] | None = None) -> int:
    from pdllm.shared.rpc.logs import configure_json_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_json_logging()
    try:
        deployment = start(args)
    except ValueError as exc:  # a bad flag value or a taken port: one line, not a traceback
        parser.exit(2, f"pdllm serve: error: {exc}\n")
    public = deployment.servers[0]
    metrics = f", metrics on port {public.metrics_port}" if public.metrics_port else ""
    # One write call: print() writes the text and the newline apart, and a log line from another thread
    # could land between them (supervisors and tests read this line to learn the address).
    sys.stderr.write(f"pdllm {args.role} serving on {public.address}{metrics}\n")
    sys.stderr.flush()
    try:
        public.serve_until_signal()
    finally:
        deployment.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
