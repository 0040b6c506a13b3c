PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-full bench setup real-model clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/activate
	$(BIN)/pip install -q -e '.[test]'

demo: setup
	$(BIN)/jaxrl-cache demo --overwrite

# The numerics-sensitive files run a second time on XLA:CPU's AVX2 code path (any x86-64
# CPU with AVX2 emits it): what a test measures must hold on every CPU, not one's figures.
# The flag holds only the code XLA emits: its dots run in YNNPACK, which picks its kernels
# from the CPU itself (AMX here, 2026-12-07), so the dots' AVX2 kernels need a real AVX2 CPU.
NUMERICS_FILES := tests/test_numerics.py tests/test_exactness.py tests/test_exactness_probe.py \
	tests/test_engine.py tests/test_lora_export.py
AVX2 := XLA_FLAGS=--xla_cpu_max_isa=AVX2

test: setup
	$(BIN)/python -m pytest tests -m 'not slow' -n 3 --dist loadfile --no-loadscope-reorder \
		--max-worker-restart=0 --durations=15
	$(AVX2) $(BIN)/python -m pytest $(NUMERICS_FILES) -m 'not slow' -n 2 --dist loadfile \
		--no-loadscope-reorder --max-worker-restart=0 -q

test-full: setup
	JAXRL_FULL_SWEEP=1 $(BIN)/python -m pytest tests -n 3 --dist loadfile --no-loadscope-reorder \
		--durations=30

bench: setup
	$(BIN)/python -m pytest benchmarks --benchmark-only
	$(BIN)/python -m benchmarks.engine_v2

# The real-model fixture (scripts/fetch_smollm2.py: SmolLM2-135M-Instruct in
# ~/.cache/jaxrl_cache, or $JAXRL_SMOLLM2_DIR) built in a torch CPU venv, which then runs the
# slow real-model tests against transformers. torch must be exactly 2.13.0 (the local wheel).
TORCH_VENV ?= .venv-torch
TORCH_BIN := $(TORCH_VENV)/bin

$(TORCH_VENV)/.installed:
	$(PY) -m venv $(TORCH_VENV)
	$(TORCH_BIN)/pip install -q torch==2.13.0 transformers gguf accelerate safetensors \
		tokenizers numpy jinja2
	$(TORCH_BIN)/pip install -q jax jaxlib flax optax orbax-checkpoint tqdm matplotlib \
		pytest hypothesis
	$(TORCH_BIN)/pip install -q -e . --no-deps
	touch $@

real-model: $(TORCH_VENV)/.installed
	$(TORCH_BIN)/python scripts/fetch_smollm2.py
	$(TORCH_BIN)/python -m pytest tests/test_real_model.py -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .benchmarks
