# Two commands set everything up on a fresh machine: `make test` and `make bench`.
# Both create .venv (seeing a torch that is already installed system-wide, e.g. a CUDA or torch_npu build),
# install torch 2.13.0 (CPU) only where no torch is present, then kvplane, its three backend
# distributions and the test extras, editable.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.kvplane-installed
TORCH  ?= torch==2.13.0
EXTRAS ?= test,bench,engines

.PHONY: install test bench lint clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py kvplane/_native/*.c backends/*/pyproject.toml
	./scripts/install-system-deps.sh
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]" -e backends/cuda -e backends/ascend -e backends/mlu
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/kvplane bench

lint: $(STAMP)
	$(VENV)/bin/ruff check kvplane backends tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info kvplane/_native/*.so bench-results
