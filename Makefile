# make test | make test-fast | make demo | make bench: each creates/reuses .venv and installs what it needs,
# the lorakit package (src/) editable among it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A stamp per requirements file makes the install idempotent: it reruns only when a file changes.
STAMP := $(VENV)/.installed
TORCH_CPU_VERSION := 2.13.0

.PHONY: install vendor-models lint test test-fast demo bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Without a GPU, install the CPU build of torch first: an unpinned torch pulls several GB of CUDA.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml | $(PY)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; \
		else $(PIP) install -q torch==$(TORCH_CPU_VERSION); fi; \
	fi
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

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
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Everything (CI, the README's command). test-fast leaves out the tests marked slow (pytest.ini) and still runs every
# stage once: the tier to run while working.
test: lint $(STAMP) $(VENDOR_STAMP)
	$(PY) -m pytest tests

test-fast: lint $(STAMP) $(VENDOR_STAMP)
	$(PY) -m pytest tests -m "not slow"

demo: $(STAMP)
	$(PY) scripts/demo/run_demo.py $(if $(QUICK),--quick,)

# On a machine with a CUDA GPU: LoRA SFT throughput and MFU, QLoRA, the chunked loss's peak memory, PPO's
# iteration split and the rollout engines' ms per token at 1B and 7B shapes (benchmarks/bench_gpu.py; outputs/bench/gpu.json). Without a GPU it says so
# and exits 2; `make gpu-check ARGS=--cpu_smoke` runs its code paths on tiny shapes on the CPU.
gpu-check: $(STAMP)
	$(PY) benchmarks/bench_gpu.py $(ARGS)

# Every benchmarks/bench_*.py but bench_gpu.py (make gpu-check) in turn (each prints its table and writes
# outputs/bench/*.json);
# requirements-bench.txt holds the baselines they compare against (TRL).
bench: $(STAMP)
	$(PIP) install -q -r requirements-bench.txt
	@set -e; for script in benchmarks/bench_*.py; do \
		if [ $$script = benchmarks/bench_gpu.py ]; then continue; fi; echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf outputs .cache .pytest_cache
