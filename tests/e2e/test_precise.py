"""Precise mode end to end: mock workers publish vLLM-format KV cache events, kvroute-relay
re-keys them and streams them into Envoy, and the filter routes on what the engines report.

What is checked against the engines' own reports (`usage.cached_tokens`, `x-worker-id`):
the stream goes live, a restarted worker stops being credited with its old cache, the
prediction matches the engine under eviction pressure (against predicted mode's figure on
the same requests), and a relay restart costs no request and is repaired.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import RELAY, Stack, Worker, request, tokens, wait_port  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(RELAY), reason="kvroute-relay not built (make relay)")

BLOCK = 16


def completion(prompt: list[int], max_tokens: int = 2) -> dict:
    return {"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens}


def post(stack: Stack, prompt: list[int]) -> tuple[str, int, int]:
    """(serving worker, kvroute's predicted cached tokens, the engine's cached tokens)."""
    status, headers, data = stack.post("/v1/completions", completion(prompt))
    assert status == 200, (status, data[:300])
    usage = json.loads(data)["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return headers["x-worker-id"], int(headers["x-kvroute-predicted-cached-tokens"]), cached


def fleet(n: int = 2, kv_blocks: int = 4096) -> list[Worker]:
    return [Worker(f"decode-{i}", role="decode", kv_blocks=kv_blocks) for i in range(1, n + 1)]


@pytest.fixture()
def precise():
    s = Stack(fleet(), kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=2, relay=True).start()
    s.wait_relay_live()
    yield s
    s.stop()


def test_engine_events_reach_every_thread_and_route_requests(precise):
    doc = tokens(1, 40 * BLOCK)
    first, predicted, _ = post(precise, doc)
    assert predicted == 0
    # The engine's BlockStored reached the index: the next request is predicted from it.
    time.sleep(0.2)
    for i in range(6):
        worker, predicted, cached = post(precise, doc + tokens(100 + i, 3 * BLOCK))
        assert worker == first
        assert cached >= 39 * BLOCK
        assert abs(predicted - cached) <= BLOCK, (predicted, cached)
    stats = precise.stats()
    assert stats.get("kvroute_precise_blocks_stored_total", 0) >= 40
    m = precise.relay.metrics()
    assert any(k.startswith("kvroute_relay_") for k in m), sorted(m)[:20]


def test_a_restarted_worker_is_not_credited_with_its_old_cache(precise):
    doc = tokens(2, 64 * BLOCK)
    first, _, _ = post(precise, doc)
    time.sleep(0.2)
    again, predicted, _ = post(precise, doc)
    assert again == first and predicted >= 60 * BLOCK
    w = next(w for w in precise.workers if w.name == first)
    w.stop()
    w.start(precise.speedup, precise.dir)
    wait_port(w.port, proc=w.proc)
    # The target: within 100 ms of the engine being back, kvroute no longer predicts it
    # holds the document.
    time.sleep(0.1)
    worker, predicted, cached = post(precise, doc)
    assert predicted == 0, f"{worker} still credited with {predicted} cached tokens after a restart"
    assert cached == 0


def eviction_run(relay: bool, bypass_every: int) -> float:
    """Share of gateway requests whose predicted cached tokens are within one block of the
    engine's. Documents total 2x the fleet's KV, Zipf popularity, 2 clients at a time; with
    `bypass_every`, every n-th request goes straight to a worker (traffic this gateway does
    not see: another gateway, a direct client), as happens in production."""
    docs = [tokens(1000 + d, 16 * BLOCK) for d in range(40)]
    rng = random.Random(5)
    order = rng.choices(range(len(docs)), [1 / (i + 1) for i in range(len(docs))], k=160)
    s = Stack(fleet(kv_blocks=160), kvroute={"disaggregation": {"threshold_tokens": 0}},
              concurrency=2, relay=relay).start()
    try:
        if relay:
            s.wait_relay_live()

        def one(k: int):
            prompt = docs[order[k]] + tokens(5000 + k, 2 * BLOCK)
            if bypass_every and k % bypass_every == 0:
                # Another gateway's tenant: its own documents, each twice the size of ours, which
                # push ours out (large enough that predicted mode's misses stand clear of
                # the noise: 0.84-0.87 against precise 0.97-0.99 over 8 runs; at the size of
                # ours the gap was 0.03-0.09 and CI once saw 0.025).
                prompt = tokens(9000 + k, 32 * BLOCK)
                w = s.workers[k // bypass_every % len(s.workers)]
                status, _, _ = request(w.port, "POST", "/v1/completions", completion(prompt))
                assert status == 200
                return None
            _, predicted, cached = post(s, prompt)
            return abs(predicted - cached) <= BLOCK

        with ThreadPoolExecutor(2) as ex:
            res = [r for r in ex.map(one, range(len(order))) if r is not None]
        return sum(res) / len(res)
    finally:
        s.stop()


def test_prediction_matches_the_engine_under_eviction_pressure():
    """Predicted cached tokens against the engine's own `cached_tokens`, request by request,
    in precise and in predicted mode on the same requests."""
    figures = {(mode, bypass): eviction_run(mode == "precise", bypass)
               for mode in ("precise", "predicted") for bypass in (0, 4)}
    print("\nwithin one block of the engine's cached tokens: " + ", ".join(
        f"{mode}{' (1 in 4 requests from elsewhere)' if bypass else ''} {v:.1%}"
        for (mode, bypass), v in figures.items()))
    assert figures[("precise", 0)] >= 0.95, figures
    assert figures[("precise", 4)] >= 0.95, figures
    # Traffic the gateway does not see is what predictions cannot know and events do.
    assert figures[("precise", 4)] > figures[("predicted", 4)] + 0.05, figures


def test_a_relay_restart_fails_no_request_and_is_repaired(precise):
    doc = tokens(3, 32 * BLOCK)
    first, _, _ = post(precise, doc)
    precise.relay.stop()
    # No relay: every request still answered, on predictions.
    for i in range(5):
        post(precise, doc + tokens(200 + i, BLOCK))
    deadline = time.time() + 5
    while time.time() < deadline and precise.stats().get("kvroute_precise_stream_live", 1) != 0:
        time.sleep(0.05)
    assert precise.stats().get("kvroute_precise_stream_failures_total", 0) >= 1
    precise.relay.start(precise.dir)
    precise.wait_relay_live(timeout=20)
    # The new relay learns from the engines again.
    other = tokens(4, 32 * BLOCK)
    w, _, _ = post(precise, other)
    time.sleep(0.2)
    again, predicted, cached = post(precise, other)
    assert again == w and abs(predicted - cached) <= BLOCK and cached >= 31 * BLOCK


def test_chat_prompts_see_engine_events_through_the_tokenizer_off_the_request_path():
    """Chat prompts hash by bytes, which the engines' token-id events never match. With
    `tokenize` the filter routes on the text at once and asks the engine for the ids beside
    the request; the answer maps the text blocks to the engine's blocks. Proof that the engines'
    reports (not the gateway's own picks) drive it: the prompt's first worker is reset and the
    prompt put on the other worker behind the gateway's back; the next turn goes there."""
    workers = fleet()
    s = Stack(workers, kvroute={"disaggregation": {"threshold_tokens": 0},
                                "tokenize": {"cluster": workers[0].name}},
              concurrency=2, relay=True).start()
    try:
        s.wait_relay_live()
        system = " ".join(f"rule {i}: answer briefly and cite the handbook section {i * 7}." for i in range(60))

        def chat(turn):
            return {"model": "mock-model", "max_tokens": 2, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question number {turn} about the handbook"}]}

        status, headers, data = s.post("/v1/chat/completions", chat(0))
        assert status == 200, data[:300]
        first = headers["x-worker-id"]
        time.sleep(0.3)
        assert s.stats().get("kvroute_tokenize_ok_total", 0) == 1
        other = next(w for w in workers if w.name != first)
        reset = next(w for w in workers if w.name == first)
        status, _, data = request(other.port, "POST", "/v1/chat/completions", chat("direct"))
        assert status == 200, data[:300]
        status, _, _ = request(reset.port, "POST", "/reset_prefix_cache", None)
        assert status == 200
        # Like vLLM, the engine publishes the reset with its next step's events: one short
        # request there makes it known. Until then the engine's word is that it still holds
        # the prompt, where the gateway placed it.
        status, _, data = request(reset.port, "POST", "/v1/completions",
                                  {"model": "mock-model", "prompt": "unrelated", "max_tokens": 1})
        assert status == 200, data[:300]
        time.sleep(0.3)
        for turn in (1, 2):
            status, headers, data = s.post("/v1/chat/completions", chat(turn))
            assert status == 200, data[:300]
            cached = json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = int(headers["x-kvroute-predicted-cached-tokens"])
            assert headers["x-worker-id"] == other.name, (turn, headers["x-worker-id"])
            # Text blocks count in estimated tokens: close to the engine's, not exact.
            assert cached > 300 and abs(predicted - cached) <= max(4 * BLOCK, 0.12 * cached), \
                (turn, predicted, cached)
            time.sleep(0.1)
        st = s.stats()
        assert st.get("kvroute_tokenize_failed_total", 0) == 0, st
    finally:
        s.stop()
