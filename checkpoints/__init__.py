"""Checkpoints: transformers safetensors import, orbax save/restore into any placement."""
