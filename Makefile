# make test | make demo | make bench: each creates/reuses .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A stamp per requirements file makes the install idempotent: it reruns only when a file changes.
STAMP := $(VENV)/.installed
TORCH_CPU_VERSION := 2.13.0

.PHONY: install test demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Without a GPU, install the CPU build of torch first: an unpinned torch pulls several GB of CUDA.
$(STAMP): requirements.txt requirements-dev.txt | $(PY)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; \
		else $(PIP) install -q torch==$(TORCH_CPU_VERSION); fi; \
	fi
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

demo: $(STAMP)
	$(PY) scripts/demo/run_demo.py $(if $(QUICK),--quick,)

# Every benchmarks/bench_*.py in turn (each prints its table and writes outputs/bench/*.json);
# requirements-bench.txt holds the baselines they compare against (TRL).
bench: $(STAMP)
	$(PIP) install -q -r requirements-bench.txt
	@set -e; for script in benchmarks/bench_*.py; do echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf outputs .cache .pytest_cache
