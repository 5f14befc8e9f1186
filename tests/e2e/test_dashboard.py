"""The operator's view, for real: the Grafana dashboard's every query through a real Prometheus
scraping a running stack, and the filter's status page.

Prometheus is Debian's package, unpacked into build/prometheus by `make prometheus` (a
dependency of `make test-e2e`). The stack is Envoy with two threads in precise mode (the relay
and the workers' KV events, so the precise-mode panels have data) in front of two mock
workers; Prometheus scrapes Envoy's /stats/prometheus every second while a small workload
runs, then every panel query of deploy/grafana/kvroute.json is evaluated through Prometheus'
HTTP API and must return data, with sensible values where the workload says what they are.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import kvstack  # noqa: E402
from kvstack import ROOT, Stack, Worker, free_port, request, stream, tokens, wait_port  # noqa: E402

PROMETHEUS = os.environ.get("PROMETHEUS_BIN", os.path.join(ROOT, "build", "prometheus", "prometheus"))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "kvroute.json")
STATUS = "/kvroute/status"
BLOCK = 16
# Grafana's $__rate_interval, as the test evaluates it: the whole workload fits in it.
RATE_INTERVAL = "30s"


class Prometheus:
    """A Prometheus server on a free port scraping Envoy's admin every second."""

    def __init__(self, admin_port: int):
        self.dir = tempfile.mkdtemp(prefix="kvroute-prom-")
        self.port = free_port()
        cfg = os.path.join(self.dir, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "scrape_configs:\n"
                    "- job_name: envoy\n"
                    "  metrics_path: /stats/prometheus\n"
                    f"  static_configs: [{{targets: ['127.0.0.1:{admin_port}']}}]\n")
        self.log = open(os.path.join(self.dir, "prometheus.log"), "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, timeout=30, proc=self.proc)
        deadline = time.time() + 30
        while True:  # listening comes before ready (503 until the TSDB is open)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5):
                    break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 15.0) -> list[dict]:
        """Until `expr` has a result (a comparison filters out samples until it holds)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            res = self.query(expr)
            if res:
                return res
            time.sleep(0.25)
        raise AssertionError(f"no data for {expr} after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def upstream_requests(stack: Stack) -> int:
    """Requests Envoy sent to any upstream cluster (the workers, the relay's excluded)."""
    _, _, body = request(stack.admin, "GET", "/stats?filter=upstream_rq_total$")
    total = 0
    for line in body.decode().splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("cluster.") and "relay" not in name:
            total += int(value)
    return total


def no_worker(headers: dict) -> bool:
    """No worker answered: Envoy names the serving endpoint in x-worker-id, and has none to
    name in a local reply."""
    return headers.get("x-worker-id") in (None, "", "-")


def status_page(port: int) -> tuple[int, dict, dict]:
    status, headers, body = request(port, "GET", STATUS)
    return status, headers, json.loads(body) if status == 200 else {}


def with_internal_listener(cfg: dict, port: int) -> dict:
    """docs/diagnosing.md's recipe: the status page on an internal listener carrying the same
    filter; the public listener refuses its path (RBAC, normalized paths) before kvroute."""
    public = cfg["static_resources"]["listeners"][0]
    hcm = public["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    router = hcm["http_filters"][-1]
    hcm["normalize_path"] = True
    hcm["merge_slashes"] = True
    hcm["http_filters"].insert(0, {"name": "envoy.filters.http.rbac", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
        "rules": {"action": "DENY", "policies": {"kvroute-status": {
            "permissions": [{"url_path": {"path": {"prefix": STATUS}}}],
            "principals": [{"any": True}]}}}}})
    internal_hcm = {
        "@type": hcm["@type"], "stat_prefix": "kvroute_status",
        "http_filters": [copy.deepcopy(wasm), copy.deepcopy(router)],
        "route_config": {"virtual_hosts": [{"name": "status", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 404}}]}]},
    }
    cfg["static_resources"]["listeners"].append({
        "name": "kvroute-status",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": internal_hcm}]}]})
    return cfg


@pytest.fixture(scope="module")
def run():
    """The stack (the status page on an internal listener), Prometheus scraping it, and the
    workload's figures once it ran."""
    assert os.path.exists(PROMETHEUS), f"{PROMETHEUS} missing: run `make prometheus` (make test-e2e does)"
    workers = [Worker(f"decode-{i}", role="decode") for i in (1, 2)]
    stack = Stack(workers, kvroute={"disaggregation": {"threshold_tokens": 0}, "status": {"path": STATUS}},
                  concurrency=2, relay=True)
    stack.internal = free_port()
    plain_config = kvstack.envoy_config
    kvstack.envoy_config = lambda *a, **kw: with_internal_listener(plain_config(*a, **kw), stack.internal)
    prom = None
    try:
        stack.start()
        kvstack.envoy_config = plain_config
        stack.wait_relay_live()
        prom = Prometheus(stack.admin)
        prom.wait_for('kvroute_requests_total{outcome="routed"}')
        figures = workload(stack)
        # Envoy merges histograms into /stats/prometheus on its stats flush (every 5 s): wait
        # until Prometheus has scraped every request's samples.
        prom.wait_for(f"sum(kvroute_route_time_us_count) >= {figures['requests']}")
        prom.wait_for("sum(kvroute_actual_hit_pct_count) >= 12")
        yield stack, prom, figures
    finally:
        kvstack.envoy_config = plain_config
        if prom:
            prom.stop()
        stack.stop()


def workload(stack: Stack) -> dict:
    """Four documents asked about three times each (token prompts: the engines' KV events
    match them), text prompts, streams with usage, and one unreadable body (a fallback)."""
    served = {}
    cached = 0
    for rnd in range(3):
        for doc in range(4):
            prompt = tokens(doc + 1, 12 * BLOCK) + tokens(100 + rnd * 10 + doc, 2 * BLOCK)
            status, headers, data = stack.post("/v1/completions",
                                               {"model": "mock-model", "prompt": prompt, "max_tokens": 2})
            assert status == 200, data[:300]
            served[headers["x-worker-id"]] = served.get(headers["x-worker-id"], 0) + 1
            cached += json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
        time.sleep(0.5)
    for i in range(4):
        body = {"model": "mock-model", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": "You answer briefly. " * 40},
                             {"role": "user", "content": f"question {i}"}]}
        status, _, _ = stream(stack.listen, "/v1/chat/completions", body)
        assert status == 200
        # As between the rounds above: the next chat may reach the other Envoy thread, which
        # learns this pick (and the engine's report of it) through replication; sent at once,
        # it is served from the cache the router did not yet credit, and `served` outgrows
        # `routed` by a whole system prompt (CI, stop 52: 0.609 against 0.545).
        time.sleep(0.5)
    status, _, _ = stack.post("/v1/completions", b"{not json")
    return {"requests": 12 + 4 + 1, "served": served, "cached_tokens": cached}


def ordered(share: dict, tol: float = 0.02) -> bool:
    """The ladder's rungs (shares of the prompt tokens) in order, within `tol`."""
    rungs = [share[r] for r in ("workload", "fleet", "routed", "served")]
    return all(a >= b - tol for a, b in zip(rungs, rungs[1:]))


def panels() -> list[dict]:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [p for p in dash["panels"] if p.get("type") != "row"]


def values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def test_every_dashboard_query_returns_data(run):
    stack, prom, figures = run
    ps = panels()
    assert len(ps) >= 15
    got = {}
    for p in ps:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL)
            res = prom.query(expr)
            assert res, f"panel {p['title']!r}: no data for {expr}"
            got[(p["title"], t.get("legendFormat", ""))] = res
    routed = {r["metric"].get("outcome"): float(r["value"][1]) for r in got[("Requests by outcome", "{{outcome}}")]}
    assert routed["routed"] > 0 and routed["fallback"] > 0, routed
    fallbacks = {r["metric"].get("reason"): float(r["value"][1]) for r in got[("Fallbacks by reason", "{{reason}}")]}
    assert fallbacks["parse_error"] > 0, fallbacks
    predicted = values(got[("Predicted vs actual hit (mean %)", "predicted")])[0]
    actual = values(got[("Predicted vs actual hit (mean %)", "actual")])[0]
    # Each document's second and third asks are mostly cached, the first not at all.
    assert 10 < predicted < 90 and 10 < actual < 90, (predicted, actual, stack.stats())
    decisions = {r["metric"]["worker"]: float(r["value"][1]) for r in got[("Decisions per worker", "{{worker}}")]}
    assert set(decisions) == {"decode-1", "decode-2"} and sum(decisions.values()) > 0, decisions
    p99 = values(got[("Route time (µs)", "p99")])[0]
    assert 0 < p99 < 1e6, p99
    assert values(got[("Precise mode", "live")]) == [1.0]
    assert values(got[("Precise mode", "fed workers")]) == [2.0]
    assert values(got[("Engine KV events", "stored")])[0] > 0
    assert values(got[("Replication between Envoy threads", "peers")])[0] >= 1
    assert values(got[("Index size", "blocks")])[0] > 0
    kinds = {r["metric"].get("kind"): float(r["value"][1]) for r in got[("Feedback read", "{{kind}}")]}
    assert kinds["usage"] > 0, kinds
    healthy = values(got[("Worker health and failures", "healthy {{worker}}")])
    assert healthy == [1.0, 1.0], healthy
    share = {r["metric"]["rung"]: float(r["value"][1])
             for r in got[("Reuse ladder (share of prompt tokens)", "{{rung}}")]}
    # Ordered (workload >= fleet >= routed >= served, 2 % of the prompt tokens tolerance),
    # and the repeated documents are reused: most of two asks in three.
    assert ordered(share), share
    assert 0.3 < share["routed"] <= 1.0, share
    lost = {k: values(got[("Where reuse is lost (share of prompt tokens)", k)])[0]
            for k in ("capacity", "balancing", "index")}
    assert all(-0.02 <= v <= 1.0 for v in lost.values()), lost


def test_status_page_on_the_internal_listener_matches_the_workload(run):
    stack, _, figures = run
    # The public listener refuses the page, however it is spelled.
    for path in (STATUS, STATUS + "/", "//kvroute/%73tatus", "/kvroute/./status?x=1"):
        status, headers, _ = request(stack.listen, "GET", path)
        assert status == 403 and no_worker(headers), (path, status, headers)
    before = upstream_requests(stack)
    status, headers, page = status_page(stack.internal)
    assert status == 200, page
    assert headers["content-type"] == "application/json"
    assert upstream_requests(stack) == before
    names = [w["name"] for w in page["workers"]]
    assert names == ["decode-1", "decode-2"]
    assert all(w["healthy"] and w["inflight"] == 0 and w["engine_fed"] for w in page["workers"]), page["workers"]
    # The internal listener's filter sees what the inference listener's routed.
    assert sum(w["index_blocks"] for w in page["workers"]) >= 12 * 4
    assert page["index"]["blocks"] > 0 and page["index"]["bytes"] > 0
    assert page["precise"]["enabled"] and page["precise"]["live"] and page["precise"]["fed_workers"] == 2
    assert page["precise"]["last_update_age_ms"] is not None and page["precise"]["last_update_age_ms"] < 60_000
    assert page["replication"]["peers"] >= 1 and page["replication"]["serving"]
    total = page["counters"]["total"]
    # Counters are Envoy's process-wide values: every thread's requests.
    assert total["routed"] + total["fallback"] == figures["requests"], total
    assert total["fallback_parse_error"] == 1
    assert total["feedback_usage"] >= 12
    # The one-minute window has everything: the stack is younger than a minute.
    grew = page["counters"]["last_60s"]["grew"]
    assert grew["routed"] + grew["fallback"] == figures["requests"], page["counters"]
    assert page["counters"]["last_60s"]["span_ms"] < 60_000
    # The reuse ladder, in total and over the last minute (all of it: the stack is younger).
    ladder = page["ladder"]["total"]["reported"]
    assert ladder["tokens"]["prompt"] > 0 and ladder["tokens"]["routed"] > 0, page["ladder"]
    sh = ladder["share"]
    assert ordered(sh), sh
    assert page["ladder"]["last_60s"]["reported"]["tokens"] == ladder["tokens"], page["ladder"]
    # Anything else on the internal listener is Envoy's 404; other methods on the page, 405.
    assert request(stack.internal, "GET", "/v1/models")[0] == 404
    assert request(stack.internal, "POST", STATUS, {"x": 1})[0] == 405


def test_status_page_is_answered_by_the_filter_never_upstream():
    kv = {"disaggregation": {"threshold_tokens": 0}, "status": {"path": STATUS}}
    with Stack([Worker("solo")], kvroute=kv, concurrency=1) as stack:
        status, headers, _ = stack.post("/v1/completions", {"model": "mock-model", "prompt": "hello " * 50, "max_tokens": 2})
        assert status == 200 and headers["x-worker-id"] == "solo"
        before = upstream_requests(stack)
        status, headers, page = status_page(stack.listen)
        assert status == 200, page
        assert no_worker(headers), headers
        assert upstream_requests(stack) == before, "the status request went upstream"
        assert page["counters"]["total"]["routed"] == 1
        assert page["workers"][0]["index_blocks"] > 0
        status, headers, _ = request(stack.listen, "DELETE", STATUS)
        assert status == 405 and no_worker(headers)
        assert upstream_requests(stack) == before


def test_status_page_is_off_by_default():
    with Stack([Worker("solo")], kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=1) as stack:
        before = upstream_requests(stack)
        status, headers, _ = request(stack.listen, "GET", STATUS)
        # Passed through to the workers like any other request the filter does not route.
        assert headers.get("x-worker-id") == "solo", (status, headers)
        assert upstream_requests(stack) == before + 1
