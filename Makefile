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

# a test whose launch failed because a rank died of a fatal signal in native code (RankFailure: "rank R died of SIGSEGV,
# a crash in native code"; once in ~60 runs, inside torch's gloo collectives) runs once more; a second crash fails it
RERUN_CRASHED := --reruns 1 --only-rerun 'died of SIG[A-Z]+, a crash in native code'

# the default suite on 2 workers, a test file each at a time (its module fixtures run once): 9.5-10.6 min against 11.3 in
# one process on a 2-core AVX2 CPU (tests/README.md); test-all stays in one process (its slow launches contend)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile $(RERUN_CRASHED) $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m '' $(RERUN_CRASHED) $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun

# The GPU check (memopt/gpu_check/). `make gpu-wheels`, where pip reaches a registry, puts into .whl/
# (git-ignored) the wheels memopt needs beyond torch and triton, and DeepSpeed's; `make gpu-check OUT=dir`,
# on a GPU machine without network access, installs them into a temporary folder and runs the check
# with that machine's own python3 and torch (no virtual environment is made).
GPU_WHEELS ?= hydra-core==1.3.8 omegaconf==2.3.1
# DeepSpeed (published as an sdist: built here into a pure-Python wheel, its setup importing the project's torch;
# its ops build on the GPU machine with ninja) and what it needs beyond torch, numpy, packaging and tqdm, for the
# check's ZeRO-Offload comparison (~6 MB)
GPU_WHEELS_DS_SDIST ?= deepspeed==0.19.8
GPU_WHEELS_DS ?= einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 \
	pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
	nvidia-ml-py==13.615.71 psutil==7.2.2
GPU_WHEELS_SDIST ?= antlr4-python3-runtime==4.9.3
GPU_PLATFORM := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: $(GPU_PLATFORM) -d .whl $(GPU_WHEELS) $(GPU_WHEELS_DS)
	$(PYTHON) -m pip wheel --quiet --no-deps -w .whl $(GPU_WHEELS_SDIST)  # published as an sdist only: a pure-Python wheel
	DS_BUILD_OPS=0 $(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w .whl $(GPU_WHEELS_DS_SDIST)
	du -sh .whl && ls .whl

gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=dir"; exit 2; }
	$(PYTHON) -m memopt.gpu_check $(OUT) $(ARGS)
