"""End-to-end: the built kvroute.wasm in a real Envoy 1.40 in front of mock workers on loopback."""

import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import Stack, Worker, request, stream, text  # noqa: E402


def decode_fleet(n=4, **kw):
    return [Worker(f"decode-{i}", role="decode", **kw) for i in range(1, n + 1)]


@pytest.fixture(scope="module")
def stack():
    s = Stack(decode_fleet(), kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=2).start()
    yield s
    s.stop()


def completion(prompt, max_tokens=4, **extra):
    return {"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens, **extra}


def worker_of(headers):
    return headers.get("x-kvroute-worker")


def ok(stack, body, path="/v1/completions"):
    status, headers, data = stack.post(path, body)
    assert status == 200, (status, data[:300])
    return headers, json.loads(data)


def test_same_long_prefix_goes_to_the_same_worker(stack):
    doc = text(1, 16000)  # ~3.5k tokens
    h0, _ = ok(stack, completion(doc + " first question"))
    first = worker_of(h0)
    assert first and h0["x-worker-id"] == first
    for i in range(6):
        h, body = ok(stack, completion(f"{doc} follow-up question number {i}"))
        assert worker_of(h) == first
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0.8 * body["usage"]["prompt_tokens"], body["usage"]
        assert int(h["x-kvroute-predicted-cached-tokens"]) > 0


def test_distinct_prompts_under_load_use_every_worker(stack):
    bodies = [completion(text(1000 + i, 4000), max_tokens=32) for i in range(24)]
    with ThreadPoolExecutor(12) as ex:
        workers = Counter(worker_of(h) for h, _ in ex.map(lambda b: ok(stack, b), bodies))
    assert set(workers) == {f"decode-{i}" for i in range(1, 5)}, workers
    assert max(workers.values()) <= 12, workers


def test_burst_of_same_prefix_spreads_once_load_dominates(stack):
    doc = text(2, 20000)
    bodies = [completion(f"{doc} user {i}", max_tokens=64) for i in range(32)]
    with ThreadPoolExecutor(32) as ex:
        workers = Counter(worker_of(h) for h, _ in ex.map(lambda b: ok(stack, b), bodies))
    assert len(workers) >= 2, workers
    assert max(workers.values()) < 32, workers


def test_chat_turn_n_plus_1_goes_where_turn_n_went(stack):
    for conv in range(3):
        messages = [{"role": "system", "content": text(300 + conv, 6000)}]
        where = None
        for turn in range(4):
            messages.append({"role": "user", "content": f"conversation {conv} turn {turn}: " + text(conv * 10 + turn, 400)})
            h, body = ok(stack, {"model": "mock-model", "messages": messages, "max_tokens": 8}, "/v1/chat/completions")
            if where is not None:
                assert worker_of(h) == where, (conv, turn, h)
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            where = worker_of(h)
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})


def test_token_id_prompts_are_routed_exactly(stack):
    base = [(i * 7919) % 50000 for i in range(2048)]
    h0, _ = ok(stack, completion(base + [1, 2, 3]))
    assert h0["x-kvroute-prompt-tokens"] == str(2051)
    h1, body = ok(stack, completion(base + [4, 5, 6, 7]))
    assert worker_of(h1) == worker_of(h0)
    assert int(h1["x-kvroute-predicted-cached-tokens"]) == 2048
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2032


def test_streaming_passes_through_chunk_by_chunk(stack):
    status, headers, chunks = stream(stack.listen, "/v1/completions",
                                     completion(text(5, 2000), max_tokens=200, stream=True,
                                                stream_options={"include_usage": True}))
    assert status == 200
    body = b"".join(c for _, c in chunks).decode()
    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["usage"]["completion_tokens"] == 200
    # Tokens arrive over time, not in one buffered lump at the end.
    assert len(chunks) >= 5, len(chunks)
    assert chunks[-1][0] - chunks[0][0] > 0.03


def test_feedback_reaches_the_load_table(stack):
    ok(stack, completion(text(7, 3000)))
    time.sleep(0.6)  # gauges publish on the 250 ms tick
    st = stack.stats()
    assert st['kvroute_feedback_total{kind="orca"}'] > 0
    assert st['kvroute_feedback_total{kind="usage"}'] > 0
    assert any(k.startswith("kvroute_worker_kv_usage_pct{") for k in st)
    assert any(k.startswith("kvroute_worker_waiting{") for k in st)
    # Requests finished: nothing left in flight, and the index holds what was routed.
    assert st["kvroute_active_requests"] == 0
    assert st["kvroute_index_blocks"] > 0


def test_client_cannot_pick_the_cluster(stack):
    status, _, _ = request(stack.listen, "GET", "/v1/models", headers={"x-kvroute-cluster": "no-such-cluster"})
    assert status == 200


def test_malformed_bodies_get_answers_not_filter_5xx(stack):
    before = stack.stats()
    cases = [
        ("POST", b"{not json"),
        ("POST", json.dumps({"model": "mock-model", "prompt": 42}).encode()),
        ("POST", json.dumps({"model": "mock-model", "messages": "hi"}).encode()),
        ("POST", b""),
        ("POST", json.dumps(completion("x" * (5 * 1024 * 1024))).encode()),
    ]
    for method, body in cases:
        status, headers, data = request(stack.listen, method, "/v1/completions", body)
        assert status < 500, (body[:60], status, data[:200])
        if status == 400:
            assert headers.get("x-kvroute-fallback") == "parse_error" or len(body) > 1_000_000
    status, _, _ = request(stack.listen, "GET", "/v1/completions")
    assert status < 500
    after = stack.stats()
    key = 'kvroute_fallbacks_total{reason="parse_error"}'
    assert after[key] - before.get(key, 0) >= 4
    # Envoy and the filter keep serving.
    h, _ = ok(stack, completion("still alive"))
    assert worker_of(h)


def test_requests_on_different_threads_see_each_other():
    # Two Envoy worker threads, each with its own wasm VM. Connections land on either thread,
    # so without replication about half of these would not know where the prefix went.
    with Stack(decode_fleet(), kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=2) as s:
        doc = text(11, 16000)
        h0, _ = ok(s, completion(doc + " q0"))
        time.sleep(0.05)
        hs = [ok(s, completion(f"{doc} q{i}"))[0] for i in range(1, 13)]
        seen = Counter(worker_of(h) for h in hs)
        # On a miss, what the deciding VM saw of every worker (debug headers are on in tests):
        # a fresh-clone CI once sent 3 of 12 elsewhere, not reproduced since.
        why = [(i + 1, h.get("x-kvroute-costs")) for i, h in enumerate(hs) if worker_of(h) != worker_of(h0)]
        assert seen == Counter({worker_of(h0): 12}), (seen, why, s.stats())
        assert s.stats()['kvroute_replication_total{kind="received"}'] > 0


def test_disaggregation_cold_prompt_to_prefill_pool_then_decode_from_cache():
    fleet = decode_fleet(2) + [Worker("prefill-1", role="prefill"), Worker("prefill-2", role="prefill")]
    with Stack(fleet, kvroute={"disaggregation": {"threshold_tokens": 2000}}) as s:
        doc = text(21, 40000)  # ~9k tokens, cold
        h0, body0 = ok(s, completion(doc, max_tokens=8))
        assert h0.get("x-kvroute-prefill-worker", "").startswith("prefill-"), h0
        assert h0["x-worker-id"] == worker_of(h0), "the decode worker served the output"
        assert body0["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * body0["usage"]["prompt_tokens"]
        h1, body1 = ok(s, completion(doc + " and one more question", max_tokens=8))
        assert "x-kvroute-prefill-worker" not in h1, ("mostly cached: no prefill pool", h0, h1)
        assert worker_of(h1) == worker_of(h0)
        assert body1["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * body1["usage"]["prompt_tokens"]
        st = s.stats()
        assert st['kvroute_disagg_decisions_total{decision="prefill"}'] == 1
        assert st['kvroute_disagg_decisions_total{decision="local"}'] == 1


def test_dead_worker_every_request_still_answered():
    with Stack(decode_fleet(), kvroute={"disaggregation": {"threshold_tokens": 0}}) as s:
        doc = text(31, 12000)
        h0, _ = ok(s, completion(doc + " warm"))
        victim = next(w for w in s.workers if w.name == worker_of(h0))
        victim.stop()
        statuses = []
        for i in range(12):
            status, h, _ = s.post("/v1/completions", completion(f"{doc} after {i}"))
            statuses.append(status)
            if status == 200:
                assert h["x-worker-id"] != victim.name
        assert statuses == [200] * 12, statuses
        with ThreadPoolExecutor(8) as ex:
            res = list(ex.map(lambda i: s.post("/v1/completions", completion(text(400 + i, 2000)))[0], range(16)))
        assert res == [200] * 16, res
        assert s.stats()[f'kvroute_worker_failures_total{{worker="{victim.name}"}}'] >= 1


def test_unknown_model_falls_back_and_is_counted():
    fleet = decode_fleet(2)
    with Stack(fleet, kvroute={"models": ["mock-model"], "unknown_model": "pass"}) as s:
        status, h, _ = s.post("/v1/completions", completion("hello", model="other-model"))
        assert h.get("x-kvroute-fallback") == "unknown_model"
        assert status == 404  # the worker's answer, passed through
        assert s.stats()['kvroute_fallbacks_total{reason="unknown_model"}'] == 1


def test_invalid_config_is_rejected_naming_the_field():
    fleet = decode_fleet(1)
    s = Stack(fleet, kvroute={"workers": [{"name": "decode-1", "kv_blocks": 0}]})
    with pytest.raises((RuntimeError, TimeoutError)):
        s.start()
    try:
        log = s.envoy_log()
        assert "workers[0].kv_blocks" in log, log[-2000:]
    finally:
        s.stop()


def test_endpoint_mode_steers_by_ip_and_port():
    with Stack(decode_fleet(3), kvroute={"steering": {"mode": "endpoint", "fallbacks": 0}}) as s:
        doc = text(41, 12000)
        h0, _ = ok(s, completion(doc + " a"))
        assert h0["x-worker-id"] == worker_of(h0)
        for i in range(4):
            h, body = ok(s, completion(f"{doc} b{i}"))
            assert worker_of(h) == worker_of(h0) == h["x-worker-id"]
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        with ThreadPoolExecutor(9) as ex:
            served = Counter(ex.map(lambda i: ok(s, completion(text(500 + i, 3000), max_tokens=32))[0]["x-worker-id"], range(18)))
        assert len(served) == 3, served


def test_client_going_away_is_not_a_worker_failure():
    import socket
    # Slow engine: the client is gone long before the first byte.
    with Stack(decode_fleet(1), kvroute={}, speedup=0.5) as s:
        body = json.dumps(completion(text(51, 40000), max_tokens=4)).encode()
        for _ in range(3):
            c = socket.create_connection(("127.0.0.1", s.listen))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.05)
            c.close()
        time.sleep(0.5)
        st = s.stats()
        assert st['kvroute_requests_total{outcome="routed"}'] == 3
        assert st['kvroute_worker_failures_total{worker="decode-1"}'] == 0
        assert st["kvroute_worker_healthy{worker=\"decode-1\"}"] == 1
        # Released: nothing stays in flight.
        assert st["kvroute_active_requests"] == 0
