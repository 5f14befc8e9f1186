# Prometheus (Debian's package, unpacked into build/prometheus by scripts/prometheus.sh): the
# dashboard test scrapes a running stack with it and evaluates every panel of
# deploy/grafana/kvroute.json. Included by the main Makefile; `test-e2e` depends on it.
PROMETHEUS := build/prometheus/prometheus

$(PROMETHEUS): scripts/prometheus.sh
	@bash scripts/prometheus.sh

.PHONY: prometheus
prometheus: $(PROMETHEUS)
