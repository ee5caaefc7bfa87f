# The two set-up commands of the README:
#   make demo   creates .venv if needed, installs the requirements and runs the offline demo
#   make test   creates/updates .venv (and .venv-cv4, OpenCV 4 for the Darknet fidelity test) and
#               runs ruff (lint and format check) plus the whole test suite
# Both work on a fresh machine that has Python 3.11, make and bash.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# OpenCV 4 alone (OpenCV 5 dropped the Darknet importer): the reference of
# tests/models/test_darknet_opencv.py, which make test requires (YOLO_REQUIRE_OPENCV4=1).
CV4_VENV := .venv-cv4
CV4_STAMP := $(CV4_VENV)/.installed-stamp

.PHONY: demo test test-env lint venv clean gpu-check

venv: $(STAMP)

# Reinstall only when a requirements file changed since the last install.
$(STAMP): requirements.txt requirements-dev.txt requirements-extra.txt requirements-onnx.txt \
		requirements-trackers.txt requirements-ray.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	@touch $(STAMP)

$(CV4_STAMP): requirements-cv4.txt
	@test -x $(CV4_VENV)/bin/python || $(PYTHON) -m venv $(CV4_VENV)
	$(CV4_VENV)/bin/python -m pip install --disable-pip-version-check -q -r requirements-cv4.txt
	@touch $(CV4_STAMP)

# The two environments make test needs; make -j2 test-env installs them side by side (.ci/run).
test-env: $(STAMP) $(CV4_STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# One pytest worker per usable core, at most 4 (each holds torch and trains small models; most
# tests use one thread). --dist loadfile keeps a file's tests, and its module fixtures, in one
# worker. PYTEST_ARGS adds to it (e.g. PYTEST_ARGS='-k freeze'); TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")

# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it (many container images do),
# every interpreter the suite starts compiled the project from source again and each worker
# re-rewrote every test module's asserts (bench/README.md "Test suite": 15% of a process-heavy
# file's time). The cached bytecode goes to __pycache__/, which git ignores.
test: lint $(CV4_STAMP)
	PYTHONDONTWRITEBYTECODE= YOLO_REQUIRE_OPENCV4=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# make gpu-check: what only a GPU can check and measure (bench/gpu_check.py, bench/README.md
# "make gpu-check"), within 570 s (--budget-s); one JSON and one markdown report in bench/results/.
# GPU_CHECK_ARGS adds to it (e.g. GPU_CHECK_ARGS='--quick' or '--steps env cuda-tests'). Without
# network (no venv can be built) but with a python that has torch: make gpu-check PY=python3
# runs with that python as it is (pycocotools missing: the steps that need it are skipped).
GPU_CHECK_ARGS ?=

gpu-check:
	@if [ "$(PY)" = "$(VENV)/bin/python" ]; then $(MAKE) --no-print-directory venv; fi
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs demo_data .pytest_cache .ruff_cache
