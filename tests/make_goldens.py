"""Regenerates tests/golden/<family>/: a tiny random transformers model and its outputs.

    python tests/make_goldens.py

The stored goldens let the model tests run where torch is not installed; CI also checks
against transformers live (tests/test_model.py).
"""

from pathlib import Path

import numpy as np
from hf_reference import FAMILIES, build_hf_model, hf_greedy, hf_logits

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30, 12]

if __name__ == "__main__":
    for family in FAMILIES:
        directory = Path(__file__).parent / "golden" / family
        model = build_hf_model(family, directory)
        np.savez(
            directory / "expected.npz",
            prompt=np.array(PROMPT),
            logits=hf_logits(model, PROMPT),
            greedy=np.array(hf_greedy(model, PROMPT, 16)),
        )
        print(family, sum(f.stat().st_size for f in directory.iterdir()), "bytes")
