# trainyard: `make demo` to try it, `make test` to check it. Each target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-gpu bench fuzz lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

## demo: a local daemon on SQLite with 4 simulated SSH nodes of 8 GPUs, in the terminal UI
demo: $(STAMP)
	$(BIN)/trainyard demo

## test: the whole suite (real sshd, SQLite and PostgreSQL, a real daemon behind the CLI and TUI)
test: $(STAMP)
	$(BIN)/pytest -q

## test-gpu: the telemetry code against real NVML (needs an NVIDIA GPU and driver)
test-gpu: $(STAMP)
	TRAINYARD_REQUIRE_GPU=1 $(BIN)/pytest -q -m gpu tests

## bench: the benchmarks in tests/bench; each prints its figures
bench: $(STAMP)
	@set -e; for f in tests/bench/bench_*.py; do echo "== $$f"; $(BIN)/python $$f; done

## fuzz: Schemathesis against a real daemon, all checks, as admin and as user (>= 20,000 cases)
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz.api_fuzz --cases 20000

lint: $(STAMP)
	$(BIN)/ruff check .
	cd playbooks && ../$(BIN)/ansible-lint --offline --profile production

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
