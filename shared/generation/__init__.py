"""Masked-diffusion generation: the shared sampler and the vanilla decoder."""
