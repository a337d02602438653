"""Triton kernels, each with its launcher and a pure-torch reference."""
