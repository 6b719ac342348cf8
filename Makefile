# Two commands on a fresh machine (CPU is enough):
#   make demo   # GRPO on GSM8K with the embedded SmolLM2-135M-Instruct, FP8 emulated on CPU
#   make test   # the test suite
#   make fresh-check   # the first of them as on a new machine: a clone of HEAD, a run-only venv, an empty model cache
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_ARGS ?=

.PHONY: demo test test-fast test-gpu lint clean-venv fresh-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.run-deps: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $@

# JetStream 0.2.2 without its dependencies: its seqio/TensorFlow tokenizer stack is never used here
$(VENV)/.dev-deps: $(VENV)/.run-deps
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,serve,notebook]"
	$(BIN)/python -m pip install -q --no-deps google-jetstream==0.2.2
	touch $@

demo: $(VENV)/.run-deps
	$(BIN)/python -m fp8rl_jax.main --config=configs/smollm2_gsm8k.py $(DEMO_ARGS)

# two workers, a test file each at a time (module fixtures stay in one process), XLA:CPU's code generation at -O0
# (tests/conftest.py); then the exact sampler's bit-for-bit tests at XLA's default optimization, as users run it
TEST_WORKERS ?= 2
EXACT_TESTS := tests/rollout/test_exact.py
test: $(VENV)/.dev-deps
	$(BIN)/python -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --durations=30 --ignore=$(EXACT_TESTS) tests
	FP8RL_TEST_XLA_OPT=default $(BIN)/python -m pytest -q -m "not gpu" $(EXACT_TESTS)

# the edit loop's target (about 4 min on 2 cores): the tests not marked slow (a test file marks itself with
# `pytestmark = pytest.mark.slow`: the trainer, rollout engine, benchmarks, notebooks, multi-process, reliability...)
test-fast: $(VENV)/.dev-deps
	$(BIN)/python -m pytest -q -m "not gpu and not slow" --durations=10 tests

# on a GPU host (Transformer Engine installed): the GPU-marked tests
test-gpu:
	python3 -m pytest -q -m gpu tests

lint: $(VENV)/.dev-deps
	$(BIN)/ruff check fp8rl_jax tests configs benchmarks

clean-venv:
	rm -rf $(VENV)

# HEAD cloned into a temporary folder, make demo DEMO_ARGS=--steps=1 there with a new venv of the run dependencies
# and an empty $$FP8RL_CACHE, then `import torch` must fail in that venv (.ci/fresh_check.sh; needs PyPI: minutes)
fresh-check:
	PYTHON=$(PYTHON) bash .ci/fresh_check.sh
