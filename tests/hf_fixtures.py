"""The committed parity fixtures (scripts/make_parity_fixtures.py): tiny random transformers
models with what transformers computed on them."""
import json
import pathlib

import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
ARCHS = ("llama3", "llama_linear", "mistral", "qwen2", "qwen3", "gemma")
SAMPLING = json.loads((FIXTURES / "sampling.json").read_text())  # name: [temp, top_k, top_p]


def expected(name: str) -> dict:
    with np.load(FIXTURES / name / "expected.npz") as data:
        return dict(data)
