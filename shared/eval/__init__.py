"""Long-context evaluation tasks and reports: needle retrieval and multi-document QA (the run itself,
vanilla vs pdllm, is ``pdllm.shared.app.eval``)."""
