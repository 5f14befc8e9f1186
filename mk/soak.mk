# Soak test (scripts/soak.py): a real Envoy (--concurrency 2) with the built wasm in front of
# mock workers, thousands of mixed requests (a third cancelled mid-stream, malformed bodies
# mixed in) for SOAK_SECONDS; then every kvroute load gauge must read 0 and Envoy's RSS must
# be flat after warm-up. Included by the main Makefile.
#   make soak                      10 minutes of load (about 11 in all)
#   make soak SOAK_SECONDS=180     a short run; SOAK_ARGS="--clients 32 --max-growth 5"

SOAK_SECONDS ?= 600
SOAK_ARGS ?=

.PHONY: soak
soak: wasm mock-worker venv
	$(PY) scripts/soak.py --seconds $(SOAK_SECONDS) $(SOAK_ARGS)
