# Two commands do all the set-up: `make train` and `make test`. Each creates the local virtual
# environment on first use (CPU wheel of torch on a CPU machine, the CUDA build on a GPU machine).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-all install clean gpu-wheels gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) -m memopt.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m '' $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun

# The GPU check (memopt/gpu_check.py). `make gpu-wheels`, where pip reaches a registry, puts into .whl/
# (git-ignored) the pure-Python wheels memopt needs beyond torch and triton; `make gpu-check OUT=dir`,
# on a GPU machine without network access, installs them into a temporary folder and runs the check
# with that machine's own python3 and torch (no virtual environment is made).
GPU_WHEELS ?= hydra-core==1.3.8 omegaconf==2.3.1
GPU_WHEELS_SDIST ?= antlr4-python3-runtime==4.9.3
GPU_PLATFORM := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: $(GPU_PLATFORM) -d .whl $(GPU_WHEELS)
	$(PYTHON) -m pip wheel --quiet --no-deps -w .whl $(GPU_WHEELS_SDIST)  # published as an sdist only: a pure-Python wheel
	du -sh .whl && ls .whl

gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=dir"; exit 2; }
	$(PYTHON) -m memopt.gpu_check $(OUT) $(ARGS)
