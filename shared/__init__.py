"""The core both roles build on: engine config, request layout, chunk prefill and chunk store, static KV,
sampler, model runtime, KV tier, RPC plumbing, the reference path; ``app`` composes the services (CLI, serve,
in-process engine, eval)."""
