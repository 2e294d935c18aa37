# Two commands set everything up on a fresh machine: `make test` and `make bench`.
# Both create .venv (seeing a torch that is already installed system-wide, e.g. a CUDA or torch_npu build),
# install torch 2.13.0 (CPU) only where no torch is present, then kvplane, its three backend
# distributions and the test extras, editable, and vLLM for the connector's tests: only where no vLLM is
# present, and without its declared dependencies (a CUDA torch, triton); the `vllm` extra brings what it imports.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.kvplane-installed
TORCH  ?= torch==2.13.0
EXTRAS ?= test,bench,engines,vllm
VLLM   ?= vllm==0.27.1 xgrammar>=0.2.1,<1.0

.PHONY: install test bench lint clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py kvplane/_native/*.c backends/*/pyproject.toml
	./scripts/install-system-deps.sh
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]" -e backends/cuda -e backends/ascend -e backends/mlu
	$(PY) -c "import vllm" 2>/dev/null || $(PIP) install -q --no-deps $(foreach p,$(VLLM),"$(p)")
	@touch $(STAMP)

test: $(STAMP)
	@$(PY) -c "import vllm.distributed.kv_transfer.kv_connector.v1.base" || \
		{ echo "vLLM does not import, so the connector tests would be skipped; run make clean install"; exit 1; }
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/kvplane bench

lint: $(STAMP)
	$(VENV)/bin/ruff check kvplane backends tests examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info kvplane/_native/*.so bench-results
