# A real inference engine behind kvroute: llama.cpp's llama-server on CPU with a tiny random-
# weight llama model, built once under build/llama/ by scripts/llama.sh (a few minutes on 2
# cores the first time, a few stat calls afterwards). Included by the main Makefile.
#
#   make llama                 build llama-server and the model if missing
#   make run ENGINE=llama      two llama-server workers on 127.0.0.1:8001-8002 behind Envoy :10000
#   make demo ENGINE=llama     the demo table (kvroute against round-robin) on llama-server
#
# The end-to-end suite (tests/e2e/test_llama.py) runs against it, so `make test-e2e` builds it.

ENGINE ?= mock
PRECISE ?=
REPLICAS ?=
export REPLICAS
export PRECISE
export ENGINE

.PHONY: llama
llama:
	@nice -n 10 bash scripts/llama.sh >/dev/null

test-e2e: llama

ifeq ($(ENGINE),llama)
run demo: llama
endif
