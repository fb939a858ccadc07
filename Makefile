# The two commands: `make demo` and `make test`. Both create .venv if it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch==2.13.0 is the CPU build this machine keeps on local disk; a looser spec would pull a
# multi-GB CUDA build. On a GPU machine, override: `make install TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/baton demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
