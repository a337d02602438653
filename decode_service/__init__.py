"""Decode workers: load selected chunk KV and run iterative masked denoising."""
