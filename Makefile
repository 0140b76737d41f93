# trainyard: `make demo` to try it, `make test` to check it. Each target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp

.PHONY: demo demo-ready test test-gpu bench fuzz lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Install into .venv with uv (seconds where pip takes a minute) when it can be had; pip otherwise,
# or when uv fails.
define install
	@if $(BIN)/python -m pip install -q uv >/dev/null 2>&1 && \
	    $(BIN)/python -m uv pip install -q --python $(BIN)/python $(1); then :; else \
	  echo "installing with pip"; $(BIN)/pip install -q $(1); fi
endef

# uv writes no bytecode (nor does Python where PYTHONDONTWRITEBYTECODE is set): compile our
# packages and what the demo imports once, not in every process that starts (the CLI, the
# daemon, each node's agent)
define compile
	@env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m compileall -q scheduler tui >/dev/null
	@env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -c 'import scheduler.demo, scheduler.server, tui.app'
endef

# the runtime only: what the daemon, CLI, TUI and demo need (no test tools)
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(call install,-e .)
	$(compile)
	@touch $@

# the runtime and the dev extra: tests, linters, benchmarks
$(STAMP): pyproject.toml | $(BIN)/python
	$(call install,-e '.[dev]')
	$(compile)
	@touch $(DEMO_STAMP) $@

## demo: a local daemon on SQLite with 4 simulated SSH nodes of 8 GPUs busy with a slice of a
## real trace, in the terminal UI (`trainyard demo --idle` for a cluster that waits for you)
demo: $(DEMO_STAMP)
	$(BIN)/trainyard demo

## demo-ready: what `make demo` does before the TUI opens (install, start, every node UP), then stop
demo-ready: $(DEMO_STAMP)
	$(BIN)/trainyard demo --no-tui --until-ready --dir "$$(mktemp -d -t trainyard-demo-XXXXXX)"

## test: the whole suite (real sshd, SQLite and PostgreSQL, a real daemon behind the CLI and TUI)
test: $(STAMP)
	$(BIN)/pytest -q

## test-gpu: the telemetry code against real NVML (needs an NVIDIA GPU and driver)
test-gpu: $(STAMP)
	TRAINYARD_REQUIRE_GPU=1 $(BIN)/pytest -q -m gpu tests

## bench: the benchmarks in tests/bench; each prints its figures
bench: $(STAMP)
	@# every benchmark runs even when one misses its target; the run fails at the end, naming them
	@# each benchmark sets its directories aside (tests/bench/_harness.py, discard): removed here, after the last
	@failed=""; for f in tests/bench/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || failed="$$failed $$f"; done; \
	  rm -rf "$${TMPDIR:-/tmp}/trainyard-bench-trash"; \
	  if [ -n "$$failed" ]; then echo "missed a target or failed:$$failed"; exit 1; fi

## fuzz: Schemathesis against a real daemon, all checks, as admin and as user (>= 20,000 cases)
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz.api_fuzz --cases 20000

lint: $(STAMP)
	$(BIN)/ruff check .
	cd playbooks && ../$(BIN)/ansible-lint --offline --profile production

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
