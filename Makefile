# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; a plain `pip install torch` would pull a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed
PYTEST_ARGS ?=

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[compile,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/bench_encoder.py

clean:
	rm -rf demo-out .pytest_cache
