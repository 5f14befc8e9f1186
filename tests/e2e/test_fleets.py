"""Fleets as deployed (issue 45): several models on their own workers, client hints, unequal
workers. The built kvroute.wasm in a real Envoy in front of mock workers on loopback; the
serving worker is read from its own `x-worker-id` header."""

import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import Stack, Worker, prom_samples, request, text  # noqa: E402

PLUGIN = {"disaggregation": {"threshold_tokens": 0}}


def model_fleet():
    """Model A on a-1, a-2; model B on b-1, b-2 (each mock serves only its own model)."""
    return [Worker(f"{m}-{i}", role="decode", models=[f"model-{m}"], args=["--model", f"model-{m}"])
            for m in "ab" for i in (1, 2)]


def completion(prompt, model="mock-model", max_tokens=4, **extra):
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}


def upstream_requests(s):
    """Requests Envoy sent to each worker's cluster."""
    _, _, body = request(s.admin, "GET", "/stats/prometheus")
    samples = prom_samples(body.decode(), ("envoy_cluster_upstream_rq_total",))
    names = {w.name for w in s.workers}
    out = {}
    for k, v in samples.items():
        name = k.split('envoy_cluster_name="', 1)[-1].split('"', 1)[0]
        if name in names:
            out[name] = v
    return out


@pytest.fixture(scope="module")
def models():
    s = Stack(model_fleet(), kvroute=PLUGIN).start()
    yield s
    s.stop()


def test_each_model_stays_on_its_own_workers(models):
    doc = text(7, 4000)
    bodies = [completion(f"{doc} {i}" if i % 3 else text(100 + i, 3000), model=f"model-{'ab'[i % 2]}",
                         max_tokens=16) for i in range(32)]
    with ThreadPoolExecutor(8) as ex:
        res = list(ex.map(lambda b: (b["model"], models.post("/v1/completions", b)), bodies))
    served = Counter()
    for model, (status, h, body) in res:
        assert status == 200, (model, status, body[:200])
        worker = h["x-worker-id"]
        assert worker.startswith(model[-1] + "-"), (model, worker)
        served[worker] += 1
    # Both workers of each pool took part.
    assert set(served) == {"a-1", "a-2", "b-1", "b-2"}, served


def test_a_model_no_worker_serves_gets_404_without_touching_a_worker(models):
    before = upstream_requests(models)
    counted = models.stats().get('kvroute_requests_total{outcome="model_not_found"}', 0)
    status, h, body = models.post("/v1/completions", completion("hello", model="model-c"))
    assert status == 404, body[:300]
    assert "x-worker-id" not in h
    err = json.loads(body)["error"]
    assert (err["code"], err["type"]) == ("model_not_found", "invalid_request_error")
    assert "model-c" in err["message"]
    assert upstream_requests(models) == before
    assert models.stats()['kvroute_requests_total{outcome="model_not_found"}'] == counted + 1
    # Chat alike.
    status, _, body = models.post("/v1/chat/completions", {"model": "model-c", "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert upstream_requests(models) == before


def test_a_model_no_worker_serves_can_pass_through():
    with Stack(model_fleet(), kvroute={**PLUGIN, "unknown_model": "pass"}) as s:
        status, h, body = s.post("/v1/completions", completion("hello", model="model-c"))
        # A worker answered: the mock's own 404 for a model it does not serve.
        assert status == 404 and h.get("x-worker-id") in {w.name for w in s.workers}, (status, h)
        assert json.loads(body)["error"]["type"] == "NotFoundError"
        assert s.stats()['kvroute_fallbacks_total{reason="unknown_model"}'] == 1
        assert sum(upstream_requests(s).values()) == 1


# --- Client hints: prompt_cache_key and the session header ---

@pytest.fixture(scope="module")
def four():
    s = Stack([Worker(f"w-{i}", role="decode") for i in range(1, 5)], kvroute=PLUGIN).start()
    yield s
    s.stop()


def served_by(s, bodies, headers=None, pause=0.0):
    """The worker of each request, sent one after another `pause` seconds apart."""
    out = []
    for b in bodies:
        status, h, body = s.post("/v1/completions", b, headers=headers)
        assert status == 200, body[:300]
        out.append(h["x-worker-id"])
        time.sleep(pause)
    return out


# A client may see its answer before Envoy has ended the request (on_log) and told the other
# thread: a next request sent at once can find the last one still charged to its worker.
# Clients of a session think between requests; these tests leave it 0.1 s.
PAUSE = 0.1


def test_same_prompt_cache_key_keeps_one_worker_at_low_load(four):
    # Unrelated texts, one after another: without a key they spread (cache balance), with
    # one they stay where the key went first.
    plain = served_by(four, [completion(text(300 + i, 3000)) for i in range(8)], pause=PAUSE)
    assert len(set(plain)) > 1, plain
    keyed = served_by(four, [completion(text(400 + i, 3000), prompt_cache_key="agent-1") for i in range(8)],
                      pause=PAUSE)
    assert len(set(keyed)) == 1, keyed
    other = served_by(four, [completion(text(500 + i, 3000), prompt_cache_key="agent-2") for i in range(8)],
                      pause=PAUSE)
    assert len(set(other)) == 1, other


def test_same_session_header_keeps_one_worker_at_low_load(four):
    got = served_by(four, [completion(text(600 + i, 3000)) for i in range(8)], headers={"x-session-id": "s-1"},
                    pause=PAUSE)
    assert len(set(got)) == 1, got


def test_a_hinted_worker_under_load_spreads_the_key(four):
    # A burst of long prompts with one key: the key's worker queues them, and the rest go
    # to idle workers (a hint never outweighs the queue).
    bodies = [completion(text(700 + i, 12000), max_tokens=32, prompt_cache_key="burst") for i in range(16)]
    with ThreadPoolExecutor(16) as ex:
        got = Counter(ex.map(lambda b: served_by(four, [b])[0], bodies))
    assert len(got) >= 3, got
    assert max(got.values()) <= 10, got


# --- Unequal workers: workers[].speed ---

def test_a_twice_as_fast_worker_takes_about_twice_the_requests():
    """A closed loop of 16 clients keeps both workers saturated with long prompts (prefill
    bound). The load kvroute sees already drains faster on the fast worker; `speed: 2`
    prices its queue in time on top, and it takes about twice the requests, more than with
    the speed left at 1 (the control, same prompts)."""
    base = 4.0

    def run(speed):
        fleet = [Worker("fast", role="decode", speed=speed, args=["--speedup", str(2 * base)]),
                 Worker("slow", role="decode")]
        with Stack(fleet, kvroute=PLUGIN, speedup=base) as s:
            bodies = [completion(text(800 + i, 24000), max_tokens=64) for i in range(120)]
            t0 = time.time()
            with ThreadPoolExecutor(16) as ex:
                got = Counter(ex.map(lambda b: served_by(s, [b])[0], bodies))
            return got, time.time() - t0

    timed, t_timed = run(2.0)
    control, t_control = run(1.0)
    ratio = timed["fast"] / max(1, timed["slow"])
    print(f"speed 2: {dict(timed)} ratio {ratio:.2f} in {t_timed:.2f} s; "
          f"speed 1: {dict(control)} in {t_control:.2f} s")
    assert 1.7 <= ratio <= 3.5, timed
    assert timed["fast"] > control["fast"], (timed, control)


def test_a_dead_workers_retries_stay_with_its_model():
    # Envoy retries a failed try on the rest of the worker's cluster: only workers serving
    # its models are there.
    with Stack(model_fleet(), kvroute=PLUGIN) as s:
        victim = next(w for w in s.workers if w.name == "b-1")
        victim.stop()
        # At once, before kvroute has seen b-1 fail: about half go there and are retried.
        bodies = [completion(text(900 + i, 2000), model="model-b") for i in range(12)]
        with ThreadPoolExecutor(12) as ex:
            res = list(ex.map(lambda b: s.post("/v1/completions", b), bodies))
        assert [r[0] for r in res] == [200] * 12, [(r[0], r[2][:100]) for r in res]
        assert {r[1]["x-worker-id"] for r in res} == {"b-2"}
        assert s.stats()['kvroute_worker_failures_total{worker="b-1"}'] >= 1
