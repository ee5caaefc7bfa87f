# The two set-up commands of the README:
#   make demo   creates .venv if needed, installs the requirements and runs the offline demo
#   make test   creates/updates .venv and runs ruff (lint and format check) plus the whole test suite
# Both work on a fresh machine that has Python 3.11, make and bash.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint venv clean

venv: $(STAMP)

# Reinstall only when a requirements file changed since the last install.
$(STAMP): requirements.txt requirements-dev.txt requirements-extra.txt requirements-onnx.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf runs demo_data .pytest_cache .ruff_cache
