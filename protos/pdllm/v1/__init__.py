"""Generated stubs for the `pdllm.v1` protos; regenerate with `python -m pdllm.protos.generate`."""
