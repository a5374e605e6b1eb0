# One-command set-up: a virtual environment with the CPU build of torch 2.13.0 first (an unpinned torch
# would pull several GB of CUDA wheels), then this project and its test tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

demo: $(STAMP)
	$(VENV)/bin/scaletrain train digits --nproc 2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
