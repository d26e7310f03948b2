# Two commands do all the set-up: `make train` and `make test`. Each creates the local virtual
# environment on first use (CPU wheel of torch on a CPU machine, the CUDA build on a GPU machine).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-all install clean

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
