# Benchmark suite (bench/README.md): `make bench` runs the default policies (kvroute, Envoy
# round-robin and ring-hash, sglang-router, vllm-router cache_aware and kv_aware, Dynamo's KV
# router in its event and approximate modes, the oracle envelope) on every scenario
# (bench/scenarios.py) at three loads, held-out split, bisects goodput at the 2 s SLO (kvroute
# and the best peer) with 2 runs per deciding load, plus the proxy-overhead test
# (about 70 min on 2 cores: 55.6 min measured before synthetic-trace, burst and agentic ran
# Dynamo and vllm-router kv_aware too, which took 17 min more on their own);
# `make bench-scenarios` (= `make bench-quick`) runs the production-like synthetic scenarios
# for kvroute and the main baselines at two loads, goodput read off the sweep (<= 8 min);
# `make bench-signals` compares router signals (real vLLM defaults against the old mock flags); `make test-peers`
# installs the peer routers and runs their end-to-end cases (tests/e2e/test_peers_dynamo.py,
# which `make test` skips where they are not installed).
# Results: bench/results/<name>/.
# Included by the main Makefile (`-include mk/*.mk`); uses its `venv` (Envoy) and `wasm`.
# Extra flags for bench/run.py: make bench BENCH_ARGS="--policies oracle,envoy-round-robin".

BENCH_VENV := build/bench-venv
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_ARGS ?=
SGLANG_ROUTER_VERSION ?= 0.3.2
VLLM_ROUTER_VERSION ?= 0.1.17
DYNAMO_VERSION ?= 1.6.1

# matplotlib for the plots, apart from the project venv.
$(BENCH_VENV)/.installed:
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check matplotlib
	@touch $@

# Peer routers from PyPI, each in its own venv, run as black boxes. A failed install is not
# fatal: the suite reports the policy as not run and goes on.
build/sglang-venv/.installed-$(SGLANG_ROUTER_VERSION):
	-python3 -m venv build/sglang-venv && build/sglang-venv/bin/pip install -q \
		--disable-pip-version-check sglang-router==$(SGLANG_ROUTER_VERSION) && touch $@

build/vllmr-venv/.installed-$(VLLM_ROUTER_VERSION):
	-python3 -m venv build/vllmr-venv && build/vllmr-venv/bin/pip install -q \
		--disable-pip-version-check vllm-router==$(VLLM_ROUTER_VERSION) && touch $@

# Dynamo's KV router (its selection service, in ai-dynamo-runtime); our glue in front of it
# (dynamo-glue, built with mock-worker): the dynamo-* policies (bench/kvbench/peers.py).
build/dynamo-venv/.installed-$(DYNAMO_VERSION):
	-python3 -m venv build/dynamo-venv && build/dynamo-venv/bin/pip install -q \
		--disable-pip-version-check ai-dynamo-runtime==$(DYNAMO_VERSION) && touch $@

# The ext_proc floor of the overhead step: a minimal gRPC endpoint picker for Envoy's ext_proc,
# built by `make relay` (the Makefile says why).
.PHONY: extproc-picker
extproc-picker: relay

# tests/e2e/test_peers_dynamo.py checks the picker, Dynamo's selection service and
# vllm-router's kv_aware mode against mock workers. make test builds only the picker: the peer
# routers are bench dependencies (minutes of pip installs), so their cases run where they are
# installed (make bench-deps) and skip, saying so, elsewhere; make test-peers installs them
# and runs the module with nothing skipped.
test-e2e: extproc-picker

.PHONY: test-peers
test-peers: venv mock-worker extproc-picker build/dynamo-venv/.installed-$(DYNAMO_VERSION) \
		build/vllmr-venv/.installed-$(VLLM_ROUTER_VERSION)
	cargo build --release -p mock-worker --bin dynamo-glue
	KVROUTE_REQUIRE_PEERS=1 $(PY) -m pytest tests/e2e/test_peers_dynamo.py -q

.PHONY: bench-deps
bench-deps: venv $(BENCH_VENV)/.installed build/sglang-venv/.installed-$(SGLANG_ROUTER_VERSION) \
		build/vllmr-venv/.installed-$(VLLM_ROUTER_VERSION) build/dynamo-venv/.installed-$(DYNAMO_VERSION)
	cargo build --release -p mock-worker -p loadgen
	@$(MAKE) --no-print-directory extproc-picker || echo "bench: the ext_proc picker did not build; the overhead step will report it as not run"
	@$(MAKE) --no-print-directory wasm || echo "bench: make wasm failed; the kvroute policies will be reported as not run"

.PHONY: bench
bench: bench-deps
	$(BENCH_PY) bench/run.py --preset full --scenario all --name full $(BENCH_ARGS)

# shared-context, agentic and docqa, held-out seeds, two loads each (round-robin near half of
# its saturation and near it), kvroute against sglang-router and Envoy's round-robin and
# ring-hash, and Dynamo's KV router on the workers' KV events at its recommended
# prefill_load_scale (dynamo-kv-tuned, issue 43); no overhead step (`make overhead`). The old
# Mooncake quick run: bench/run.py --preset quick --scenario conversation.
BENCH_SCENARIOS_POLICIES := kvroute,sglang-cache-aware,envoy-round-robin,envoy-ring-hash,dynamo-kv-tuned

.PHONY: bench-scenarios
bench-scenarios: bench-deps
	$(BENCH_PY) bench/run.py --preset quick --scenario shared-context,agentic,docqa --split heldout \
		--policies $(BENCH_SCENARIOS_POLICIES) --no-overhead --name scenarios $(BENCH_ARGS)

.PHONY: bench-quick
bench-quick: bench-scenarios

# Only the proxy-overhead step (about 1.5 minutes): latency direct, through Envoy, through Envoy
# with kvroute, through Envoy's ext_proc filter calling a minimal endpoint picker (the ext_proc
# floor), warm and cold prompts of 1k-128k tokens, interleaved, with each Envoy's CPU per
# request; results in bench/results/overhead/. No peer routers needed.
.PHONY: overhead
overhead: venv $(BENCH_VENV)/.installed extproc-picker
	cargo build --release -p mock-worker -p loadgen
	@$(MAKE) --no-print-directory wasm
	$(BENCH_PY) bench/run.py --preset quick --only-overhead --name overhead $(BENCH_ARGS)

# kvroute with real vLLM's signals against the mock's old ones (bench/README.md).
.PHONY: bench-signals
bench-signals: bench-deps
	$(BENCH_PY) bench/signals.py $(BENCH_ARGS)

# Routing on real vLLM (bench/vllm.py, issue 41): three vLLM CPU engines with a small KV cache,
# kvroute (predicted and precise) against Envoy's round-robin and ring-hash, sglang-router and
# vllm-router on one multi-turn shared-prefix chat workload, two loads, two repeats; the
# engines' own hit rate, TTFT p50/p90, failed requests. 9 min on this 2-core machine under
# contention, the engines' start (2.5 min) included. Not part of make test. Results:
# bench/results/vllm/.
.PHONY: bench-vllm
bench-vllm: vllm bench-deps relay
	$(BENCH_PY) bench/vllm.py $(BENCH_ARGS)

# Precise mode against predicted mode (bench/precise.py, issue 42): every scenario on 8 and 4
# workers (no worse beyond the A/A band), and docqa where predictions fail (traffic that
# bypasses the gateway, caches reset, a wrong kv_blocks, two gateways that do not share), three
# router seeds each, held-out. No peer routers needed. Results: bench/results/precise/.
.PHONY: bench-precise
bench-precise: venv $(BENCH_VENV)/.installed relay
	cargo build --release -p mock-worker -p loadgen
	@$(MAKE) --no-print-directory wasm
	$(BENCH_PY) bench/precise.py --name precise $(BENCH_ARGS)
