"""Long-context evaluation: needle retrieval and multi-document QA, vanilla vs pdllm."""
