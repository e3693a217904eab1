# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; a plain `pip install torch` would pull a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed
PYTEST_ARGS ?=
# pytest-xdist workers for make test (CI has 2 cores; 0 runs the suite in one process). A module's tests stay on one
# worker (--dist loadscope), so its fixtures are built once; the session's artifacts are shared (tests/conftest.py).
TEST_WORKERS ?= 2

ANCHOR_VENV ?= .venv-anchor

.PHONY: install demo test typecheck docs gpu-check bench anchor-venv clean

$(STAMP): pyproject.toml setup.py Makefile $(wildcard kiln/kernels/*.cpp kiln/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[compile,serve,eval,dev,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP) typecheck docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# the documentation site (mkdocs.yml -> site/), offline, warnings as errors; part of make test
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# mypy over the TensorRT modules against the public tensorrt-stubs (no GPU needed); part of make test
typecheck: $(STAMP)
	$(PY) tools/typecheck.py

# On a machine with an NVIDIA GPU (after pip install -e '.[gpu]'): TensorRT engines built, run and timed (< 8 min)
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py

# The anchor (optimum-onnx + ONNX Runtime optimizer) lives in its own venv: it pins an older transformers.
$(ANCHOR_VENV)/.installed:
	test -x $(ANCHOR_VENV)/bin/python || $(PYTHON) -m venv $(ANCHOR_VENV)
	$(ANCHOR_VENV)/bin/pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(ANCHOR_VENV)/bin/pip install -q --disable-pip-version-check optimum-onnx onnxruntime onnx-ir  # onnx-ir: ORT's INT4 quantizer
	touch $@

anchor-venv: $(ANCHOR_VENV)/.installed

bench: $(STAMP) $(ANCHOR_VENV)/.installed
	$(PY) tools/bench_encoder.py
	$(PY) tools/bench_decoder.py
	$(PY) tools/bench_int8.py
	$(PY) tools/bench_int4_encoder.py
	$(PY) tools/bench_int4.py
	$(PY) tools/bench_prune.py
	$(PY) tools/bench_prune_decoder.py
	$(PY) tools/load_serve.py

clean:
	rm -rf demo-out .pytest_cache site
