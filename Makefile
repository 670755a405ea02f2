# splitserve developer entry points. `make run` and `make test` set up .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
TORCH   ?= torch==2.13.0
# GPU machines: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX ?=

.PHONY: setup run test fuzz lint typecheck proto fmt clean bench kvbench

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(BIN)/splitserve demo

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# the seeded fuzz tests at full size (make test runs a few hundred cases of each)
fuzz: setup
	SPLITSERVE_FUZZ_CASES=10000 $(BIN)/python -m pytest -q -m fuzz --timeout 3600

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy engine kvtransfer coordinator kernels prefill decode splitserve

fmt: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: setup
	$(BIN)/python -m splitserve.protogen

bench: setup
	$(BIN)/python -m engine.bench

kvbench: setup
	$(BIN)/kvbench run --backend ucx,tcp

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
