# prvrlab developer entry points.  `make quickstart` and `make test` set
# everything up on a fresh machine (a virtual environment in .venv) first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed first and pinned here so that the project's range
# (torch>=2.6) is already satisfied: on a CPU-only machine with a local
# CPU wheel this avoids pulling several GB of CUDA packages.  Users with
# GPUs may set TORCH_SPEC to the build they want.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup bytecode quickstart test test-fast bench clean

$(BIN)/prvrlab: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

setup: $(BIN)/prvrlab bytecode

# The package's bytecode, written even where PYTHONDONTWRITEBYTECODE is set (container images often
# set it; then every Ray worker compiled prvrlab's sources again, ~0.3 CPU-s a process).  Files
# already up to date are skipped; a stale .pyc is never used (Python checks each source's mtime).
bytecode: $(BIN)/prvrlab
	@$(BIN)/python -m compileall -q prvrlab || echo "note: some of prvrlab's bytecode was not written (above); those files are compiled in each process instead"

quickstart: setup
	$(BIN)/prvrlab data synth --preset small --out data/synth
	$(BIN)/prvrlab train configs/gmmformer_synth.yaml
	$(BIN)/prvrlab eval "$$(ls -td results/gmmformer_synth-*/files | head -1)/best_model.pt" --split test
	@echo "open the MLflow UI with: $(BIN)/mlflow ui --backend-store-uri sqlite:///$$(pwd)/mlflow.db"
	@echo "then http://127.0.0.1:5000, switch 'Model training' (top left), experiment prvrlab-synth (README: Browsing results in MLflow)"

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_train.py
	$(BIN)/python benchmarks/bench_eval.py

clean:
	rm -rf results mlflow.db data/synth
