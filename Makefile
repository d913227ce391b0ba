# Set-up and entry points. Torch is installed first as torch==2.13.0 (the local CPU
# build); any other torch spec would pull several GB of CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS_STAMP := $(VENV)/.ds-ops

.PHONY: demo test install ops ds-configs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
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
test: $(OPS_STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

ds-configs: $(STAMP)
	$(PY) tools/sync_ds_configs.py

clean:
	rm -rf build $(VENV)
