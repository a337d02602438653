"""Decode workers: load selected chunk KV and run iterative masked denoising.

Modules: ``decode`` (StaticKV, the DecodePolicy protocol, the decode loop over the shared sampler),
``attention`` (segmented split + LSE merge, contiguous buffer + SDPA, Triton split-S over pages),
``graphs`` (CUDA-graph replay of a decode step).
"""
