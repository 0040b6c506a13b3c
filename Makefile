PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-full bench setup clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/activate
	$(BIN)/pip install -q -e '.[test]'

demo: setup
	$(BIN)/jaxrl-cache demo --overwrite

test: setup
	$(BIN)/python -m pytest tests -m 'not slow' -n 2 --dist loadfile --durations=15

test-full: setup
	JAXRL_FULL_SWEEP=1 $(BIN)/python -m pytest tests -n 2 --dist loadfile --durations=30

bench: setup
	$(BIN)/python -m pytest benchmarks --benchmark-only
	$(BIN)/python -m benchmarks.engine_v2

clean:
	rm -rf $(VENV) runs .pytest_cache .benchmarks
