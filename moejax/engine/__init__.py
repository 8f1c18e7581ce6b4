"""jit-compiled prefill and decode over an explicit KV cache, sampling, and the generation loop."""
