"""Proto package root mirroring the proto package `pdllm` (see protos/generate.py for why it is nested)."""
