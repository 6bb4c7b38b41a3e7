"""Checkpoint loaders: a GGUF file or a Hugging Face folder -> `Checkpoint` (HF names, numpy arrays)."""
