"""dLLM model runtime (Dream / LLaDA / SDAR families) and checkpoint loading."""
