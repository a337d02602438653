"""Training the shipped default model: synthetic long-context data, tokenizer, diffusion objective."""
