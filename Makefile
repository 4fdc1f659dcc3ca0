# make test | make test-fast | make demo | make bench: each creates/reuses .venv and installs what it needs,
# the lorakit package (src/) editable among it, at the exact versions of requirements-lock.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A stamp per requirements file makes the install idempotent: it reruns only when a file changes.
STAMP := $(VENV)/.installed
TORCH_CPU_VERSION := 2.13.0
# requirements*.txt keep the ranges (the package's dependencies); the lock pins what the two commands install, used
# as pip constraints so the suite that passed here is the one a fresh machine gets tomorrow. `make lock` adds what a
# changed requirements file needs and keeps every other pin; `make lock UPGRADE=1` moves every pin to the newest the
# ranges allow. torch and its CUDA stack (triton, nvidia-*, cuda-*) stay out: the machine's build of torch decides
# them (the CPU build pinned above, or the user's CUDA build).
LOCK := requirements-lock.txt
LOCK_INPUTS := requirements.txt requirements-dev.txt requirements-bench.txt
LOCK_PYTHON := 3.11
LOCK_EXCLUDED := torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+

.PHONY: install vendor-models lint test test-fast test-latest lock demo bench gpu-check clean

# Without a GPU, the CPU build of torch first: an unpinned torch pulls several GB of CUDA. $(1): the environment's pip,
# $(2): its constraints (torch's own dependencies, sympy and the like, are in the lock).
define install_torch
	@if ! $(1) show -q torch >/dev/null 2>&1; then \
		if command -v nvidia-smi >/dev/null 2>&1; then $(1) install -q $(2) torch; \
		else $(1) install -q $(2) torch==$(TORCH_CPU_VERSION); fi; \
	fi
endef

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): requirements.txt requirements-dev.txt $(LOCK) pyproject.toml | $(PY)
	$(call install_torch,$(PIP),-c $(LOCK))
	$(PIP) install -q -c $(LOCK) -r requirements.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

# The lock for Python >= $(LOCK_PYTHON) on every platform (uv's universal resolution: markers where a pin differs),
# resolved against the CPU torch above; `uv` itself is a dev requirement, so the lock pins the tool that writes it.
lock: | $(PY)
	$(PIP) install -q $(if $(wildcard $(LOCK)),-c $(LOCK),) uv
	@set -e; echo "torch==$(TORCH_CPU_VERSION)" > $(VENV)/torch-pin.txt; \
	compile="$(VENV)/bin/uv pip compile -q --universal --python-version $(LOCK_PYTHON) $(LOCK_INPUTS) \
		-c $(VENV)/torch-pin.txt $(if $(UPGRADE),--upgrade,)"; \
	excluded=$$($$compile --no-annotate --no-header | sed -nE 's/^($(LOCK_EXCLUDED))==.*/--no-emit-package \1/p'); \
	$$compile $$excluded --custom-compile-command "make lock" -o $(LOCK)

install: $(STAMP)

# Real tokenizers and chat templates of other model families, as test fixtures with no hub: llama.cpp
# vendors vocabulary-only GGUF files (Llama-2/3, Qwen2, Phi-3, GPT-2, Gemma, ...) and the published chat
# templates of ~70 models, and both ship in the llama-cpp-python sdist on PyPI. Download it once, keep only
# those files (flattened) and drop the rest; tests/helpers/families.py builds its fixtures from them.
LLAMA_CPP_PYTHON_VERSION := 0.3.36
VENDOR := .cache/vendor
VENDOR_MODELS := $(VENDOR)/llama.cpp-models
VENDOR_STAMP := $(VENDOR_MODELS)/.extracted

$(VENDOR_STAMP): | $(PY)
	rm -rf $(VENDOR_MODELS) && mkdir -p $(VENDOR_MODELS)
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION) -d $(VENDOR)/
	tar -xzf $(VENDOR)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(VENDOR_MODELS) \
		--strip-components=4 --wildcards \
		'*/vendor/llama.cpp/models/ggml-vocab-*.gguf' '*/vendor/llama.cpp/models/templates/*.jinja'
	rm -f $(VENDOR)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz
	touch $(VENDOR_STAMP)

vendor-models: $(VENDOR_STAMP)

# ruff.toml: one line length (120), one import order, pyflakes and pycodestyle. (`ruff format` reads the same
# settings for a file you reformat; the hand layout is not enforced.)
# ruff (ruff.toml), then mypy over the package (pyproject.toml's [tool.mypy]: function bodies checked, zero errors).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Everything (CI, the README's command). test-fast leaves out the tests marked slow (pytest.ini) and still runs every
# stage once: the tier to run while working.
test: lint $(STAMP) $(VENDOR_STAMP)
	$(PY) -m pytest tests

test-fast: lint $(STAMP) $(VENDOR_STAMP)
	$(PY) -m pytest tests -m "not slow"

# Tomorrow's breakage today: the newest versions the ranges allow (no lock) in an environment of their own, then the
# fast tier on them. Run before each submission; a failure is fixed, or the range narrowed with the reason.
LATEST_VENV := .venv-latest
LATEST_PIP := $(LATEST_VENV)/bin/python -m pip
test-latest: $(VENDOR_STAMP)
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PIP) install -q --upgrade pip
	$(call install_torch,$(LATEST_PIP))
	@# torch stays the machine's build (the CPU one pinned above): an upgrade by the eager strategy would pull CUDA.
	$(LATEST_VENV)/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" \
		> $(LATEST_VENV)/torch-pin.txt
	$(LATEST_PIP) install -q --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch-pin.txt \
		-r requirements.txt -r requirements-dev.txt
	$(LATEST_PIP) install -q --no-deps -e .
	@$(LATEST_PIP) list --format=freeze | grep -iE '^(torch|transformers|peft|accelerate|datasets|deepspeed|bitsandbytes|tokenizers)=='
	$(LATEST_VENV)/bin/python -m pytest tests -m "not slow"

demo: $(STAMP)
	$(PY) scripts/demo/run_demo.py $(if $(QUICK),--quick,)

# On a machine with a CUDA GPU, one plan of at most 8 minutes (ARGS="--plan rl|sft|moe", default rl): rl the rollout
# engines, a PPO iteration and a GRPO step; sft LoRA SFT throughput and MFU against TRL + Liger and peak memory; moe a
# Qwen3-MoE shape and QLoRA PPO (benchmarks/bench_gpu.py, the benchmarks/gpu package; outputs/bench/gpu-PLAN.json).
# Without a GPU it says so and exits 2; `make gpu-check ARGS="--cpu_smoke --plan rl"` runs that plan's code paths on
# tiny shapes on the CPU.
gpu-check: $(STAMP)
	$(PY) benchmarks/bench_gpu.py $(ARGS)

# Every benchmarks/bench_*.py but bench_gpu.py (make gpu-check) in turn (each prints its table and writes
# outputs/bench/*.json);
# requirements-bench.txt holds the baselines they compare against (TRL).
bench: $(STAMP)
	$(PIP) install -q -c $(LOCK) -r requirements-bench.txt
	@set -e; for script in benchmarks/bench_*.py; do \
		if [ $$script = benchmarks/bench_gpu.py ]; then continue; fi; echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf outputs .cache .pytest_cache $(LATEST_VENV)
