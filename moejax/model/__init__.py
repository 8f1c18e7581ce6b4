"""The model: parameters with logical axes, attention (GQA, MLA), router, MoE block, decoder."""
