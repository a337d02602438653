"""Common code: model runtime, configs, sampler, KV format and KV tier, CLI."""
