"""KV tier: chunk-KV value format, in-process CPU LRU store, Redis store, stacked tiers."""
