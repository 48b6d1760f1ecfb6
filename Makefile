# The product's commands. `make install` is idempotent: it reinstalls only when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# ONNX Runtime's build: `gpu` (onnxruntime-gpu) where an NVIDIA GPU answers `nvidia-smi -L`, else `cpu`;
# `make serve ORT=cpu` overrides. The two packages are never installed together: switching removes the other.
ORT ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
$(if $(filter $(ORT),cpu gpu),,$(error ORT must be cpu or gpu, got '$(ORT)'))
OTHER_ORT := $(if $(filter $(ORT),gpu),onnxruntime,onnxruntime-gpu)
# what serving needs (`make serve`, `make export`): the runtime; `make install` and `make test` add the dev tooling
# (pytest, the real clients the tests drive, the browser test's chromium) on top of it
RUNTIME_STAMP := $(VENV)/.runtime-$(ORT)
STAMP := $(VENV)/.installed-$(ORT)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

GPU_VENV := .venv-gpu
# onnxruntime-genai, the peer of `python -m bench model --presets llama-whole`: it brings onnxruntime 1.32,
# which must not meet ours, so it has an environment of its own (bench/genai_peer.py runs there)
GENAI_VENV := .venv-genai

.PHONY: install runtime browser test lint format serve bench bench-peers bench-server-peers export reference clean gpu-install gpu-proof

install: $(STAMP)

runtime: $(RUNTIME_STAMP)

$(RUNTIME_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) with ONNX Runtime's $(ORT) build (a minute or more the first time; pip's progress follows)"
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(BIN)/python -m pip uninstall --yes --quiet $(OTHER_ORT) 2>/dev/null || true
	$(BIN)/python -m pip install --progress-bar on -e ".[export,serving,$(ORT)]"
	@rm -f $(VENV)/.runtime*
	@touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	@echo "installing the dev tooling into $(VENV) (tests, the real clients they drive, ruff)"
	$(BIN)/python -m pip install --progress-bar on -e ".[export,serving,dev,$(ORT)]"
	@$(MAKE) --no-print-directory browser
	@rm -f $(VENV)/.installed*
	@touch $(STAMP)

# Debian's chromium and chromedriver for the /inspect page's browser test (tests/fixtures/browser.py),
# installed where we are root with apt-get; elsewhere that test is skipped, naming what is missing.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver (apt-get) for the browser test"; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver \
			|| echo "apt-get could not install chromium: the browser test will be skipped"; \
	else echo "no /usr/bin/chromium or /usr/bin/chromedriver, and not root with apt-get: the browser test will be skipped"; fi

# the tests run the whole-model bench's onnxruntime-genai peer too: its venv is made here, not in their time
test: install bench-peers
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

export: runtime
	$(BIN)/python -m serving ensure --repository model_repository

serve: runtime
	$(BIN)/python -m serving $(MODEL)

bench: install
	$(BIN)/python -m bench

bench-peers: install
	$(BIN)/python -c "from bench.whole_model import ensure_genai_venv; print(ensure_genai_venv())"

# The generation bench's server peers (bench/server_peers.py), once, into .peers/: llama.cpp's server built from
# llama-cpp-python's source distribution (about 8 minutes on 2 cores), vLLM CPU in a venv of its own (3.4 GB)
bench-server-peers: install
	$(BIN)/python -m bench.server_peers

# docs/reference.md from the code (tests/test_guide.py fails when it is stale)
reference: install
	$(BIN)/python docs/reference.py

# The GPU proof (docs/gpu.md) on a CUDA host: its own environment with onnxruntime-gpu instead of the
# CPU build, then parity, decode latency against the HBM floor and the models served on the GPU.
gpu-install: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: pyproject.toml
	@test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --upgrade "pip>=24"
	$(GPU_VENV)/bin/python -m pip install --quiet -e ".[export,serving,dev,gpu]"
	@touch $@

gpu-proof: gpu-install
	$(GPU_VENV)/bin/python -m bench gpu

clean:
	rm -rf $(VENV) $(GPU_VENV) $(GENAI_VENV) build *.egg-info .pytest_cache .ruff_cache
