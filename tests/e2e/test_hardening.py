"""End-to-end hardening (issue 12): what a hostile or unlucky client can do to the routing VM,
tried against the built kvroute.wasm in a real Envoy in front of mock workers."""

import json
import os
import socket
import struct
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import kvstack  # noqa: E402
from kvstack import RawWorker, Stack, Worker, request, text  # noqa: E402


def completion(prompt, max_tokens=4, **extra):
    return {"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens, **extra}


def routed_total(stack):
    return stack.stats().get('kvroute_requests_total{outcome="routed"}', 0.0)


def failures(stack, worker):
    return stack.stats().get(f'kvroute_worker_failures_total{{worker="{worker}"}}', 0.0)


def assert_vm_never_crashed(stack):
    log = stack.envoy_log()
    for sign in ("panicked", "Plugin configured to fail", "wasm vm crashed"):
        assert sign not in log, f"{sign!r} in the Envoy log:\n{log[-3000:]}"


# ---- HTTP/2 cleartext by hand (prior knowledge): just enough to send one request with any
# bytes in :path and read the response status.

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, GOAWAY, RST = 0, 1, 4, 7, 3
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
# HPACK static-table indexes of ":status: <code>".
STATIC_STATUS = {0x88: 200, 0x89: 204, 0x8A: 206, 0x8B: 304, 0x8C: 400, 0x8D: 404, 0x8E: 500}


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (lengths < 127)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def read_frame(sock):
    head = b""
    while len(head) < 9:
        piece = sock.recv(9 - len(head))
        if not piece:
            return None
        head += piece
    length = int.from_bytes(head[:3], "big")
    payload = b""
    while len(payload) < length:
        piece = sock.recv(length - len(payload))
        if not piece:
            return None
        payload += piece
    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload


def h2c_post(port, path: bytes, body: bytes, timeout=10.0):
    """One POST over h2c; returns the response status (None if the stream was reset)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        block = b"".join([
            literal(b":method", b"POST"), literal(b":scheme", b"http"),
            literal(b":authority", b"localhost"), literal(b":path", path),
            literal(b"content-type", b"application/json"),
        ])
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block)
                  + frame(DATA, END_STREAM, 1, body))
        while True:
            f = read_frame(s)
            if f is None:
                return None
            kind, flags, stream, payload = f
            if kind == SETTINGS and not flags & ACK:
                s.sendall(frame(SETTINGS, ACK, 0))
            elif kind == HEADERS and stream == 1:
                # Envoy sends :status first; the common codes are static-table indexes.
                return STATIC_STATUS.get(payload[0], -1) if payload else -1
            elif kind in (RST, GOAWAY):
                return None


@pytest.fixture(scope="module")
def stack():
    # One Envoy worker thread: every request below shares the VM the bad one reaches.
    fleet = [Worker(f"decode-{i}", role="decode") for i in (1, 2)]
    s = Stack(fleet, kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=1).start()
    yield s
    s.stop()


def test_h2c_path_with_non_utf8_bytes_does_not_crash_the_vm(stack):
    body = json.dumps(completion("hello over h2c")).encode()
    # Control: h2c itself works and is routed.
    before = routed_total(stack)
    assert h2c_post(stack.listen, b"/v1/completions", body) == 200
    assert routed_total(stack) == before + 1

    # A generation in flight on the same thread while the bad request arrives.
    result = {}

    def long_stream():
        result["r"] = kvstack.stream(stack.listen, "/v1/completions",
                                     completion(text(7, 400), max_tokens=200, stream=True))

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.3)
    for bad in (b"/v1/completions\xff\xfe", b"/v1/\x80\x81completions", b"/\xc3(\xa0\xa1"):
        status = h2c_post(stack.listen, bad, body)
        # Not a route: passed through to the default worker, whose HTTP parser refuses a
        # URI that is not ASCII (400). With the VM crashed, Envoy answered 503 instead.
        assert status == 400, (bad, status)
    t.join(30)
    status, _, chunks = result["r"]
    assert status == 200
    sse = b"".join(c for _, c in chunks)
    assert sse.rstrip().endswith(b"data: [DONE]"), sse[-200:]
    assert sse.count(b'"text"') >= 200

    # The same VM still routes, with its state (load back to 0, stats kept).
    before = routed_total(stack)
    status, headers, _ = stack.post("/v1/completions", completion("after the bad ones"))
    assert status == 200 and headers.get("x-kvroute-worker", "").startswith("decode-")
    assert routed_total(stack) == before + 1
    assert_vm_never_crashed(stack)


def test_forged_kv_transfer_is_not_honoured(stack):
    # A cold prompt with a forged hand-off header: a decode worker that trusted it would
    # report all but one prompt token as cached.
    status, _, data = stack.post("/v1/completions", completion(text(4242, 4000)),
                                 {"x-kvroute-kv-transfer": "100000"})
    assert status == 200, data[:300]
    usage = json.loads(data)["usage"]
    assert usage["prompt_tokens"] > 500
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage


@pytest.mark.parametrize("path", ["/v1/completions/", "//v1//completions", "/v1/%63ompletions?x=1"])
def test_other_spellings_of_the_route_are_routed_and_accounted(stack, path):
    before = routed_total(stack)
    status, headers, data = stack.post(path, completion(f"spelling {path}"))
    # The mock, like vLLM's router, serves only the canonical path: a 200 means kvroute
    # forwarded it canonical, and the routed counter that it was accounted.
    assert status == 200, (path, status, data[:200])
    assert headers.get("x-kvroute-worker", "").startswith("decode-")
    assert routed_total(stack) == before + 1


def test_forged_decode_endpoint_never_reaches_the_named_address():
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    trap_ep = "127.0.0.1:%d" % trap.getsockname()[1]
    fleet = [Worker("decode-1", role="decode"), Worker("prefill-1", role="prefill")]
    with Stack(fleet, kvroute={"disaggregation": {"threshold_tokens": 50}}, concurrency=1) as s:
        assert fleet[1].allowed_decode == [fleet[0].endpoint]
        forged = {"x-kvroute-decode-endpoint": trap_ep, "x-kvroute-kv-transfer": "99999"}
        status, headers, data = s.post("/v1/completions", completion(text(99, 3000)), forged)
        assert status == 200, data[:300]
        # kvroute replaced the forged name with its own pick from the pool.
        assert headers.get("x-prefill-worker-id") == "prefill-1"
        assert headers.get("x-worker-id") == "decode-1"
        # Straight to the prefill worker, bypassing Envoy: its allow-list refuses the trap.
        status, _, data = request(fleet[1].port, "POST", "/v1/completions",
                                  completion(text(98, 300)), {"x-kvroute-decode-endpoint": trap_ep})
        assert status == 400 and b"not an allowed decode endpoint" in data
        with pytest.raises(BlockingIOError):
            trap.accept()
    trap.close()


def breaker(cfg):
    """A circuit breaker of one request per worker cluster: Envoy answers the overflow itself."""
    for c in cfg["static_resources"]["clusters"]:
        c["circuit_breakers"] = {"thresholds": [{"max_requests": 1, "max_pending_requests": 1,
                                                 "max_retries": 0}]}
    return cfg


def rate_limit(cfg):
    """A local rate limiter of one request per minute, after kvroute (so kvroute has routed
    the request when the limiter answers 429), like a per-tenant limit."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]

    def pct(n):
        return {"default_value": {"numerator": n, "denominator": "HUNDRED"}, "runtime_key": "rl"}

    hcm["http_filters"].insert(len(hcm["http_filters"]) - 1, {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "tenant",
            "token_bucket": {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "60s"},
            "filter_enabled": pct(100),
            "filter_enforced": pct(100),
        },
    })
    return cfg


def limited_stack(monkeypatch, change, **kw):
    base = kvstack.envoy_config
    monkeypatch.setattr(kvstack, "envoy_config", lambda *a, **k: change(base(*a, **k)))
    fleet = [Worker("decode-1", role="decode")]
    return Stack(fleet, kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=1, **kw)


def healthy(stack, worker):
    time.sleep(0.6)  # gauges refresh on the 250 ms tick
    return stack.stats().get(f'kvroute_worker_healthy{{worker="{worker}"}}')


def test_envoy_overflow_503_is_not_a_worker_failure(monkeypatch):
    with limited_stack(monkeypatch, breaker, speedup=1.0) as s:
        # One long generation holds the only request slot of decode-1's cluster.
        held = []
        slow = threading.Thread(target=lambda: held.append(
            s.post("/v1/completions", completion("hold", max_tokens=150))[0]))
        slow.start()
        time.sleep(0.5)
        codes = []
        for i in range(3):
            status, headers, _ = s.post("/v1/completions", completion(f"overflow {i}"))
            codes.append((status, headers.get("x-envoy-overloaded"), headers.get("x-kvroute-worker")))
        assert all(c == (503, "true", "decode-1") for c in codes), codes
        assert failures(s, "decode-1") == 0
        assert healthy(s, "decode-1") == 1
        slow.join(60)
        assert held == [200]
        status, headers, _ = s.post("/v1/completions", completion("served again"))
        assert status == 200 and headers.get("x-kvroute-worker") == "decode-1"
        assert_vm_never_crashed(s)


def test_rate_limit_429_is_not_a_worker_failure(monkeypatch):
    with limited_stack(monkeypatch, rate_limit) as s:
        codes = [s.post("/v1/completions", completion(f"tenant {i}"))[0] for i in range(3)]
        assert codes == [200, 429, 429], codes
        assert routed_total(s) == 3
        assert failures(s, "decode-1") == 0
        assert healthy(s, "decode-1") == 1


def non_utf8_upstream(_request):
    """A broken or hostile upstream: header values that are not UTF-8 (Envoy passes such
    bytes through to the filter)."""
    out = json.dumps({"choices": [{"text": "x"}],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.\xff\xfe\r\n"
            b"x-odd: \x80\r\n"
            b"content-length: " + str(len(out)).encode() + b"\r\nconnection: close\r\n\r\n" + out)


def test_upstream_header_values_that_are_not_utf8_do_not_crash_the_vm():
    with Stack([RawWorker("raw-1", non_utf8_upstream)], kvroute={"disaggregation": {"threshold_tokens": 0}},
               concurrency=1) as s:
        for i in range(3):
            status, headers, data = s.post("/v1/completions", completion(f"raw {i}"))
            assert status == 200, (status, data[:200])
            assert headers.get("x-kvroute-worker") == "raw-1"
        assert routed_total(s) == 3
        assert s.stats().get('kvroute_feedback_total{kind="usage"}') == 3
        assert_vm_never_crashed(s)
