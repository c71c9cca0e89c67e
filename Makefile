# The two commands of the README: `make demo` and `make test`. Both bootstrap .venv first.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
SETUP_INPUTS := requirements/lock.txt requirements/no-deps.txt pyproject.toml

.PHONY: setup demo test test-fast lint clean-venv

setup: $(STAMP)

# Re-runs only when the pins or the package metadata change: a second `make test` installs nothing.
$(STAMP): $(SETUP_INPUTS)
	@py=$$(bash .ci/find-python312) || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
	  echo "setup: creating $(VENV) with $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/lock.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/no-deps.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

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
	rm -rf $(VENV)
