"""dLLM model runtime (Dream / LLaDA families) and checkpoint loading."""
