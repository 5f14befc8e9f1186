# docker-compose quickstart, registry-free images, config validation and release packaging.
# Included by the main Makefile (`-include mk/*.mk`); uses its WASM and ENVOY_VERSION when set.

KVROUTE_WASM_FILE = $(or $(WASM),build/kvroute.wasm)

# kvroute/mock-worker:latest and (no registry needed) envoyproxy/envoy:v$(ENVOY_VERSION).
# Each is rebuilt only when its inputs changed.
.PHONY: images
images:
	@ENVOY_VERSION=$(or $(ENVOY_VERSION),1.40.0) bash scripts/build-images.sh

# The quickstart on a real Docker engine, torn down afterwards. Skips without an engine unless
# KVROUTE_REQUIRE_DOCKER=1.
.PHONY: compose-test
# One retry: a run (1 in ~5 here) saw Envoy serve a healthy worker's cluster from its
# failover hosts right after start-up; a failure that repeats is real and fails the build.
compose-test:
	@ENVOY_VERSION=$(or $(ENVOY_VERSION),1.40.0) bash scripts/compose-test.sh || { \
		echo "compose-test: failed once; running it again to tell a start-up race from a real failure"; \
		ENVOY_VERSION=$(or $(ENVOY_VERSION),1.40.0) bash scripts/compose-test.sh; }

# envoy --mode validate on every Envoy YAML we ship, and the Kubernetes manifests' fields.
.PHONY: validate-configs
validate-configs:
	@ENVOY_VERSION=$(or $(ENVOY_VERSION),1.40.0) bash scripts/validate-configs.sh

# Release artifacts: the filter, its checksum in sha256sum format (what Istio's WasmPlugin
# `sha256` and Envoy's remote wasm source take), and the deploy/ manifests with that checksum
# (and KVROUTE_WASM_URL, when given) filled in, under build/dist/.
.PHONY: dist
dist: wasm
	@cd $(dir $(KVROUTE_WASM_FILE)) && sha256sum $(notdir $(KVROUTE_WASM_FILE)) > $(notdir $(KVROUTE_WASM_FILE)).sha256
	@rm -rf build/dist && mkdir -p build/dist && cp -r deploy build/dist/deploy
	@sum=$$(cut -d' ' -f1 $(KVROUTE_WASM_FILE).sha256); \
	find build/dist/deploy -name '*.yaml' -exec sed -i \
		-e "s/0000000000000000000000000000000000000000000000000000000000000000/$$sum/g" \
		$(if $(KVROUTE_WASM_URL),-e "s|https://example.com/kvroute/v0.1.0/kvroute.wasm|$(KVROUTE_WASM_URL)|g") {} +; \
	echo "dist: $(KVROUTE_WASM_FILE) ($$(stat -c %s $(KVROUTE_WASM_FILE)) bytes)"; \
	echo "dist: sha256 $$sum ($(KVROUTE_WASM_FILE).sha256)"; \
	echo "dist: manifests with this checksum in build/dist/deploy$(if $(KVROUTE_WASM_URL),, (set KVROUTE_WASM_URL=https://... to fill the download URL too))"
TEST_EXTRA += validate-configs compose-test
