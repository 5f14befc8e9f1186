"""The Envoy settings kvroute ships for the edge (issue 12), tried on stacks built by the same
generator and options as envoy/demo.yaml (scripts/envoyconf.py): no debug headers, client
x-envoy-* headers without effect, stalled clients cut off by the request timeouts, the
overload manager's connection limit, prefill workers pinned to their decode pool."""

import json
import os
import re
import socket
import sys
import threading
import time

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import demo  # noqa: E402
import envoyconf  # noqa: E402
import kvstack  # noqa: E402
from kvstack import Stack, Worker, request, text  # noqa: E402

SHIPPED = ("envoy/demo.yaml", "examples/docker-compose/envoy.yaml")


def completion(prompt, max_tokens=4, **extra):
    return {"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens, **extra}


def demo_options():
    """kvroute's options in envoy/demo.yaml and the compose config (a fresh copy)."""
    return json.loads(json.dumps(envoyconf.DEMO_OPTIONS))


def hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def shipped_bootstraps():
    """The bootstraps of the shipped files as Envoy reads them, with the plugin JSON parsed."""
    for path in SHIPPED:
        site, fleet, plugin = envoyconf.shipped()[path]
        yield path, envoyconf.plain(envoyconf.bootstrap(site, fleet, plugin)), plugin


def kvroute_headers(headers: dict) -> list[str]:
    return sorted(k for k in headers if k.startswith("x-kvroute"))


# ---- 1. debug headers

@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_configs_turn_debug_headers_off(path):
    with open(os.path.join(ROOT, path)) as f:
        committed = f.read()
    assert re.findall(r'"debug_headers": (\w+)', committed) == ["false"]
    assert envoyconf.shipped()[path][2]["debug_headers"] is False


@pytest.fixture(scope="module")
def demo_like():
    """Two decode workers and a prefill worker behind the demo's kvroute options and Site.
    Speedup 1: a reply takes a measurable time (prefill >= 16 ms, ~6 ms per token)."""
    fleet = [Worker("decode-1", role="decode"), Worker("decode-2", role="decode"), Worker("prefill-1", role="prefill")]
    s = Stack(fleet, kvroute=demo_options(), speedup=1.0, concurrency=1).start()
    yield s
    s.stop()


def test_demo_like_stack_sends_no_debug_headers_and_workers_name_themselves(demo_like):
    status, headers, _ = demo_like.post("/v1/completions", completion("hello " * 50))
    assert status == 200
    assert kvroute_headers(headers) == []
    assert headers.get("x-worker-id") in ("decode-1", "decode-2")

    # A long cold prompt (> 5000 tokens) goes through the prefill worker, which names itself
    # in x-prefill-worker-id; x-worker-id is the decode worker it handed off to.
    status, headers, body = demo_like.post("/v1/completions", completion(text(4242, 30000)), timeout=120)
    assert status == 200, body[:300]
    assert kvroute_headers(headers) == []
    assert headers.get("x-prefill-worker-id") == "prefill-1"
    assert headers.get("x-worker-id") in ("decode-1", "decode-2")


# ---- 2. client x-envoy-* headers

def test_shipped_configs_use_the_peer_address_and_trust_no_client():
    for path, cfg, _ in shipped_bootstraps():
        h = hcm(cfg)
        assert h["use_remote_address"] is True, path
        assert h["xff_num_trusted_hops"] == 0, path
        # Present but empty, Envoy 1.40 counts loopback and RFC 1918 clients as internal
        # (the control in the next test shows it).
        assert "internal_address_config" not in h, path


def slow_completion():
    # ~30 tokens at ~6 ms each plus prefill: well over the 20 ms the headers ask for.
    return completion(text(77, 2000), max_tokens=30)


def untrusted_headers_have_no_effect(stack) -> tuple[float, int, str]:
    """(seconds, status, attempts) of a slow request carrying a 20 ms timeout, then the
    attempt count of a 404 that asks to be retried three times."""
    t0 = time.monotonic()
    status, _, body = stack.post("/v1/completions", slow_completion(), headers={
        "x-envoy-upstream-rq-timeout-ms": "20", "x-envoy-upstream-rq-per-try-timeout-ms": "20"})
    took = time.monotonic() - t0
    bad, headers, _ = stack.post("/v1/completions", {**completion("retry me"), "model": "no-such-model"}, headers={
        "x-envoy-retry-on": "retriable-status-codes,5xx,reset", "x-envoy-retriable-status-codes": "404,400",
        "x-envoy-max-retries": "3"})
    assert bad in (400, 404)
    return took, status, headers.get("x-envoy-attempt-count", "")


def test_client_envoy_headers_do_not_change_timeouts_or_retries(demo_like):
    took, status, attempts = untrusted_headers_have_no_effect(demo_like)
    assert status == 200 and took > 0.1, (status, took)
    assert attempts == "1"


def test_control_the_same_headers_work_for_a_trusted_client(monkeypatch):
    """With an empty internal_address_config this loopback client counts as internal: the
    same headers then cut the request at 20 ms and retry the 404. Without this the test above
    could pass because the headers never did anything."""
    real = kvstack.envoy_config

    def trusting(*a, **kw):
        cfg = real(*a, **kw)
        hcm(cfg)["internal_address_config"] = {}
        return cfg

    monkeypatch.setattr(kvstack, "envoy_config", trusting)
    fleet = [Worker("decode-1", role="decode"), Worker("decode-2", role="decode")]
    with Stack(fleet, kvroute=demo_options(), speedup=1.0, concurrency=1) as s:
        took, status, attempts = untrusted_headers_have_no_effect(s)
    assert status == 504 and took < 2.0, (status, took)
    assert attempts == "4"


# ---- 3. stalled clients

def load_gauges(stack) -> dict:
    return {k: v for k, v in stack.stats().items()
            if re.match(r"kvroute_worker_(inflight|prefill_tokens|active_blocks)\{", k)}


def wait_gauges_zero(stack, timeout=10.0) -> dict:
    deadline = time.time() + timeout
    g = load_gauges(stack)
    while time.time() < deadline and any(g.values()):
        time.sleep(0.2)
        g = load_gauges(stack)
    return g


def raw_exchange(port: int, data: bytes, timeout: float) -> tuple[float, bytes]:
    """Send `data` and nothing more; (seconds until Envoy answered, the answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(data)
        answer = b""
        while b"\r\n\r\n" not in answer:
            piece = s.recv(4096)
            if not piece:
                break
            answer += piece
        return time.monotonic() - t0, answer


def test_shipped_configs_bound_the_request_but_not_the_generation():
    for path, cfg, _ in shipped_bootstraps():
        h = hcm(cfg)
        assert h["request_timeout"] == "60s" and h["request_headers_timeout"] == "10s", path
        assert h["stream_idle_timeout"] in ("300s", "600s"), path


def test_stalled_body_and_headers_get_408_and_leave_no_load():
    fleet = [Worker("decode-1", role="decode"), Worker("decode-2", role="decode")]
    site = {"request_timeout": "2s", "request_headers_timeout": "1s"}
    opts = {**demo_options(), "disaggregation": {"threshold_tokens": 0}}
    with Stack(fleet, kvroute=opts, speedup=1.0, concurrency=1, site=site) as s:
        body = json.dumps(completion(text(5, 4000))).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        took, answer = raw_exchange(s.listen, head + body[: len(body) // 2], timeout=30)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 1.5 < took < 6, took

        took, answer = raw_exchange(s.listen, b"POST /v1/completions HTTP/1.1\r\nHost: kvroute\r\n", timeout=30)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.5 < took < 4, took

        # A generation longer than request_timeout is not cut: the timer stopped when the
        # request went upstream. The gauges count it while it runs (so they can read non-zero).
        result = {}

        def generate():
            t0 = time.monotonic()
            result["r"] = kvstack.stream(s.listen, "/v1/completions",
                                         completion(text(6, 400), max_tokens=600, stream=True), timeout=60)
            result["took"] = time.monotonic() - t0

        t = threading.Thread(target=generate)
        t.start()
        time.sleep(1.0)
        during = load_gauges(s)
        t.join(60)
        status, _, chunks = result["r"]
        assert status == 200 and result["took"] > 2.5, (status, result["took"])
        assert b"".join(c for _, c in chunks).rstrip().endswith(b"data: [DONE]")
        assert during.get('kvroute_worker_inflight{worker="decode-1"}', 0) + \
            during.get('kvroute_worker_inflight{worker="decode-2"}', 0) == 1, during

        after = wait_gauges_zero(s)
        assert len(after) >= 6 and not any(after.values()), after


# ---- 4. overload manager

def test_shipped_configs_configure_the_overload_manager():
    for path, cfg, _ in shipped_bootstraps():
        om = cfg["overload_manager"]
        monitors = {m["name"]: m["typed_config"] for m in om["resource_monitors"]}
        assert monitors["envoy.resource_monitors.global_downstream_max_connections"][
            "max_active_downstream_connections"] == 10000, path
        assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == 4 << 30, path
        actions = {a["name"]: a["triggers"][0]["threshold"]["value"] for a in om["actions"]}
        assert actions == {"envoy.overload_actions.disable_http_keepalive": 0.95,
                           "envoy.overload_actions.stop_accepting_requests": 0.98}, path


def test_connection_limit_refuses_the_extra_client_and_envoy_no_longer_warns():
    fleet = [Worker("decode-1", role="decode")]
    with Stack(fleet, kvroute=demo_options(), concurrency=1, site={"max_downstream_connections": 3}) as s:
        held = [socket.create_connection(("127.0.0.1", s.listen), timeout=5) for _ in range(3)]
        try:
            time.sleep(0.3)
            extra = socket.create_connection(("127.0.0.1", s.listen), timeout=5)
            extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: kvroute\r\n\r\n")
            try:
                answer = extra.recv(4096)
            except ConnectionResetError:
                answer = b""
            extra.close()
            assert answer == b"", answer[:100]
        finally:
            for c in held:
                c.close()
        # Below the limit again, clients are served.
        deadline = time.time() + 5
        status = 0
        while time.time() < deadline and status != 200:
            try:
                status, _, _ = request(s.listen, "GET", "/v1/models", timeout=2)
            except OSError:
                time.sleep(0.1)
        assert status == 200
        _, _, body = request(s.admin, "GET", "/stats?filter=overload")
        assert b"fixed_heap.pressure" in body
        log = s.envoy_log()
    assert "no configured limit to the number of allowed active downstream connections" not in log


# ---- 5. prefill workers pinned to their pool

def test_make_run_prefill_workers_hand_off_only_to_the_demo_decode_pool():
    fleet = envoyconf.demo_fleet()
    for w in fleet:
        cmd = demo.worker_command(w, fleet)
        if w.role == "prefill":
            allowed = cmd[cmd.index("--allowed-decode-endpoints") + 1].split(",")
            assert allowed == [f"127.0.0.1:{p}" for p in (8001, 8002, 8003, 8004)]
        else:
            assert "--allowed-decode-endpoints" not in cmd


@pytest.mark.parametrize("path,pool", [
    ("examples/docker-compose/docker-compose.yaml", "decode-{}:8000"),
    ("deploy/workers/workers.yaml", "decode-{}.llm.svc.cluster.local:8000"),
])
def test_shipped_prefill_workers_hand_off_only_to_their_decode_pool(path, pool):
    with open(os.path.join(ROOT, path)) as f:
        manifest = f.read()
    # Every worker command is a flow list "[--host, ..., --role, <role>, ...]".
    commands = re.findall(r"(?:command|args): \[(.*?)\]", manifest, re.S)
    prefill = [c for c in commands if re.search(r"--role,\s*prefill", c)]
    assert prefill
    anchors = {}
    for c in prefill:
        m = re.search(r'--allowed-decode-endpoints,\s*(?:&(\S+)\s+)?(\*\S+|"[^"]+")', c)
        assert m, c
        if m.group(1):
            anchors["*" + m.group(1)] = m.group(2)
        value = anchors.get(m.group(2), m.group(2)).strip('"')
        assert value.split(",") == [pool.format(i) for i in (1, 2, 3, 4)], c
