"""Prefill workers: chunk prefill, chunk scoring, top-K/top-B selection, KV publication."""
