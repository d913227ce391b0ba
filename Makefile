# Set-up and entry points. Torch is installed first as torch==2.13.0 (the local CPU build); any
# other torch spec would pull several GB of CUDA wheels. Everything else installs at the versions
# the suite last passed with (constraints.txt, tools/constraints.py); `make test-latest` tries the
# newest releases in a separate environment and reports what changed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS_STAMP := $(VENV)/.ds-ops
LATEST := .venv-latest
PYTEST := -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

.PHONY: demo test test-latest install ops ds-configs constraints clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# DeepSpeed compiles its CPU ops (cpu_adam, fused_adam, shm comm) on first use, again for
# every new .venv. tools/build_ds_ops.py compiles them once per machine into a DeepSpeed
# wheel cached in ~/.cache/ds-megatron-toolkit/ and installs it here, so that neither a new
# checkout nor any test spends minutes compiling.
$(OPS_STAMP): $(STAMP)
	DS_ACCELERATOR=cpu $(PY) tools/build_ds_ops.py
	touch $(OPS_STAMP)

ops: $(OPS_STAMP)

# The main job on the built-in example: plan and generate every config for Llama-3-70B on 1024 H100.
demo: $(STAMP)
	$(VENV)/bin/toolkit plan examples/llama70b_1024gpu.yaml
	$(VENV)/bin/toolkit config examples/llama70b_1024gpu.yaml --out build/demo --overwrite

# The whole test suite (CPU; multi-rank tests launch 2-4 gloo ranks as subprocesses).
# Every interpreter the suite starts (~400: ranks, launchers, CLI runs) imports the project's modules:
# compiled once here, they are read from __pycache__ also where PYTHONDONTWRITEBYTECODE is set (which
# keeps each process from writing them, so each one compiled them again).
PYC := $(PY) -m compileall -q -j 0 toolkit converters recipes tests tools benchmarks examples

test: $(OPS_STAMP)
	$(PYC) > /dev/null
	DS_ACCELERATOR=cpu $(PY) $(PYTEST)

# The newest releases the project's dependency ranges admit, in $(LATEST): what changed against
# constraints.txt, then the suite. After a green run there, `make constraints VENV=$(LATEST)` adopts them.
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q torch==2.13.0
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	DS_ACCELERATOR=cpu $(LATEST)/bin/python tools/build_ds_ops.py
	$(LATEST)/bin/python tools/constraints.py diff
	$(LATEST)/bin/python -m compileall -q -j 0 toolkit converters recipes tests tools benchmarks examples > /dev/null
	DS_ACCELERATOR=cpu $(LATEST)/bin/python $(PYTEST); status=$$?; \
	  $(LATEST)/bin/python tools/constraints.py diff; exit $$status

constraints:
	$(PY) tools/constraints.py write

ds-configs: $(STAMP)
	$(PY) tools/sync_ds_configs.py

clean:
	rm -rf build $(VENV) $(LATEST)
