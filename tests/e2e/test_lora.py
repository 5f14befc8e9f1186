"""End-to-end: LoRA adapters. The built kvroute.wasm in a real Envoy in front of mock workers
that serve three adapters with one adapter slot each (vLLM's --lora-modules, --max-loras 1),
reading which worker served each request from `x-worker-id` and the adapter loads from the
workers' own `mock:lora_loads_total`."""

import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import Stack, Worker, prom_samples, request, text  # noqa: E402

ADAPTERS = ["sql", "chat", "code", "math"]
LORA_ARGS = ["--enable-lora", "--lora-modules", *[f"{a}=/adapters/{a}" for a in ADAPTERS],
             "--max-loras", "1", "--lora-load-ms", "200"]


def fleet():
    return [Worker(f"w{i}", role="decode", args=list(LORA_ARGS)) for i in range(4)]


@pytest.fixture(scope="module")
def stack():
    # 200 ms loads: rank-64 adapters of an 8B model (see the mock's README for rank 16).
    s = Stack(fleet(), kvroute={"models": ["mock-model", *ADAPTERS],
                                "lora": {"adapters": ADAPTERS, "max_loras": 1, "load_ms": 200},
                                "metrics": {"poll_ms": 250}},
              speedup=20.0, concurrency=2).start()
    yield s
    s.stop()


def completion(model, prompt, max_tokens=4, **extra):
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}


def served(stack, body):
    status, headers, data = stack.post("/v1/completions", body)
    assert status == 200, (status, data[:300])
    return headers["x-worker-id"]


def one_by_one(stack, bodies):
    """Workers that served `bodies` sent one after another, each after the previous one's
    end has reached every Envoy thread (its load no longer counts anywhere)."""
    out = []
    for b in bodies:
        out.append(served(stack, b))
        time.sleep(0.05)
    return Counter(out)


def worker_metrics(w):
    _, _, body = request(w.port, "GET", "/metrics")
    return body.decode()


def loads(stack):
    """Adapter loads per worker, from the mocks' own counters."""
    return {w.name: prom_samples(worker_metrics(w), ("mock:lora_loads_total",)).get("mock:lora_loads_total", 0)
            for w in stack.workers}


def test_the_mock_lists_adapters_and_reports_them_as_vllm_does(stack):
    w = stack.workers[0]
    _, _, body = request(w.port, "GET", "/v1/models")
    ids = [(m["id"], m["parent"]) for m in json.loads(body)["data"]]
    assert ids == [("mock-model", None)] + [(a, "mock-model") for a in ADAPTERS]
    status, _, data = request(w.port, "POST", "/v1/completions", completion("nope", "x"))
    assert status == 404, data
    status, _, _ = request(w.port, "POST", "/v1/completions", completion("sql", "hello", max_tokens=1))
    assert status == 200
    text_ = worker_metrics(w)
    info = [ln for ln in text_.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert info and all('max_lora="1"' in ln for ln in info), info
    newest = max(info, key=lambda ln: float(ln.rsplit(" ", 1)[1]))
    assert 'running_lora_adapters=""' in newest and 'waiting_lora_adapters=""' in newest, info


def test_requests_for_an_adapter_go_to_a_worker_that_has_it_loaded(stack):
    before = loads(stack)
    first = served(stack, completion("chat", text(1, 2000)))
    time.sleep(0.05)
    # Other prompts for the same adapter, one after another: every one to the worker that
    # loaded it, while other workers have a free slot.
    seen = one_by_one(stack, [completion("chat", text(10 + i, 2000)) for i in range(8)])
    assert seen == Counter({first: 8}), seen
    # Another adapter: its own worker (the first holds `chat` in its only slot).
    other = served(stack, completion("code", text(30, 2000)))
    assert other != first
    time.sleep(0.05)
    again = one_by_one(stack, [completion("code", text(40 + i, 2000)) for i in range(4)])
    assert again == Counter({other: 4}), again
    after = loads(stack)
    assert sum(after.values()) - sum(before.values()) == 2, (before, after)


def test_a_burst_for_a_new_adapter_loads_it_on_few_workers(stack):
    before = loads(stack)
    bodies = [completion("math", text(100 + i, 200), max_tokens=16) for i in range(10)]
    with ThreadPoolExecutor(8) as ex:
        per = Counter(ex.map(lambda b: served(stack, b), bodies))
    after = loads(stack)
    new = sum(after.values()) - sum(before.values())
    # Round robin would load it on all 4 workers (and evict what they held); kvroute loads
    # it where the first request went and spills only when that worker's queue outweighs a
    # load elsewhere.
    assert len(per) <= 2 and new <= 2, (per, before, after)
    assert max(per.values()) >= 5, per


def test_the_metrics_poller_sees_adapters_other_clients_loaded(stack):
    """A client that bypasses the gateway runs `sql` on one worker; the poller reads it from
    `vllm:lora_requests_info` and the gateway's `sql` requests follow it there."""
    target = next(w for w in stack.workers if w.name not in {served(stack, completion("chat", "warm"))})
    done = threading.Event()

    def direct():
        request(target.port, "POST", "/v1/completions", completion("sql", "long running", max_tokens=12000))
        done.set()

    t = threading.Thread(target=direct)
    t.start()
    try:
        time.sleep(1.0)  # at least three polls
        assert not done.is_set(), "the direct request ended before the poller could see it"
        got = one_by_one(stack, [completion("sql", text(200 + i, 1500)) for i in range(3)])
        assert got == Counter({target.name: 3}), (target.name, got)
    finally:
        t.join()


def test_an_adapter_no_worker_serves_gets_404_without_touching_a_worker(stack):
    before = sum(prom_samples(worker_metrics(w), ("vllm:request_success_total",)).get(
        'vllm:request_success_total{engine="0",model_name="mock-model"}', 0) for w in stack.workers)
    status, h, body = stack.post("/v1/completions", completion("poetry", "hello"))
    assert status == 404 and "x-worker-id" not in h, (status, h)
    assert json.loads(body)["error"]["code"] == "model_not_found"
    after = sum(prom_samples(worker_metrics(w), ("vllm:request_success_total",)).get(
        'vllm:request_success_total{engine="0",model_name="mock-model"}', 0) for w in stack.workers)
    assert after == before
