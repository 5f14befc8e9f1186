"""kvroute's LoRA routing in front of real vLLM: the session's vLLM CPU engines (conftest.py
`vllm_engines`: the tiny model of scripts/vllm_install.sh, shared with test_vllm.py) serving
two rank-8 adapters written when they start (random, seeded, torch + safetensors from the vLLM
venv: no download) with `--enable-lora --max-loras 2`, and Envoy with the built filter and its
metrics poller on.

Checked against the engines themselves: which engine served a request (`x-worker-id`), what
each engine's `vllm:lora_requests_info` lists, and the adapters' own outputs. Skipped when vLLM
is not installed, except under `make test` (KVROUTE_REQUIRE_VLLM=1)."""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from contextlib import contextmanager

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import (  # noqa: E402
    VLLM_MODEL,
    VLLM_SITE,
    Stack,
    VllmWorker,
    prom_samples,
    request,
    text,
    vllm_kvroute,
)

pytestmark = pytest.mark.vllm

POLL_MS = 250
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def engines(vllm_engines):
    vllm_engines.revive()
    return vllm_engines


@contextmanager
def gateway(engines):
    """A fresh Envoy + kvroute (its own adapter table) with the metrics poller on; one Envoy
    thread and a fixed seed: equal costs are broken alike in every such gateway."""
    cfg = vllm_kvroute(poll_ms=POLL_MS, debug_headers=True, seed=7, models=[VLLM_MODEL, *engines.adapters],
                       lora={"adapters": list(engines.adapters), "max_loras": engines.max_loras, "load_ms": 50})
    s = Stack(engines.workers, kvroute=cfg, site=dict(VLLM_SITE), concurrency=1)
    s.start_workers()
    s.start_envoy()
    try:
        time.sleep(3 * POLL_MS / 1000)  # the poller's first reports are in
        yield s
    finally:
        s.stop(workers=False)


def body(model: str, prompt: str, max_tokens: int = 4) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def via_gateway(s: Stack, model: str, prompt: str, max_tokens: int = 4) -> tuple[str, dict]:
    status, h, data = s.post(COMPLETIONS, body(model, prompt, max_tokens))
    assert status == 200, (status, data[:300])
    return h["x-worker-id"], json.loads(data)


def direct(w: VllmWorker, model: str, prompt: str, max_tokens: int = 4) -> dict:
    status, _, data = request(w.port, "POST", COMPLETIONS, body(model, prompt, max_tokens))
    assert status == 200, (status, data[:300])
    return json.loads(data)


def lora_sets(w: VllmWorker) -> dict[str, float]:
    """The engine's own `vllm:lora_requests_info` label sets (value: when last current)."""
    _, _, data = request(w.port, "GET", "/metrics")
    return prom_samples(data.decode(), ("vllm:lora_requests_info",))


def newest_running(w: VllmWorker) -> str:
    sets = lora_sets(w)
    if not sets:
        return ""
    labels = max(sets, key=sets.get)
    return labels.split('running_lora_adapters="', 1)[1].split('"', 1)[0]


def test_an_adapter_stays_on_the_engine_that_loaded_it(engines):
    """(b) Requests for `sql` (distinct prompts, no prefix affinity) all go to the engine that
    loaded it first while it has a slot; no other engine ever runs `sql` (its own metric)."""
    with gateway(engines) as s:
        got = [via_gateway(s, "sql", text(100 + i, 300))[0] for i in range(6)]
    assert len(set(got)) == 1, got
    others = [w for w in engines.workers if w.name != got[0]]
    mine = next(w for w in engines.workers if w.name == got[0])
    assert others
    assert any("sql" in k for k in lora_sets(mine)), lora_sets(mine)
    for other in others:
        assert not any("sql" in k for k in lora_sets(other)), (other.name, lora_sets(other))


def test_answers_are_the_adapters_own(engines):
    """(c) Through the gateway every model answers 200 with its own output: each adapter's
    greedy text differs from the base model's and the other adapter's, and equals what an
    engine serving that adapter directly answers."""
    prompt = text(7, 200)
    with gateway(engines) as s:
        out = {m: via_gateway(s, m, prompt, max_tokens=8) for m in [VLLM_MODEL, *engines.adapters]}
    texts = {m: r["choices"][0]["text"] for m, (_, r) in out.items()}
    assert all(r["model"] == m for m, (_, r) in out.items()), {m: r["model"] for m, (_, r) in out.items()}
    assert len(set(texts.values())) == 3, texts
    for m in engines.adapters:
        for w in engines.workers:
            assert direct(w, m, prompt, max_tokens=8)["choices"][0]["text"] == texts[m], (m, w.name)


def test_the_poller_reads_real_vllm_lora_metric(engines):
    """(a) `chat` runs on the engine a fresh gateway does not pick (the same seed picks the same
    engine again without the poller: checked), sent there directly; the next gateway's poller
    reads it from that engine's `vllm:lora_requests_info` and its `chat` requests go there."""
    with gateway(engines) as s:
        default = via_gateway(s, "chat", text(300, 300))[0]
    target = next(w for w in engines.workers if w.name != default)
    with gateway(engines) as s:
        # A long streamed `chat` request on the target, seen running in the engine's own metric
        # and for several polls, then dropped (vLLM aborts it).
        conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=60)
        try:
            conn.request("POST", COMPLETIONS, json.dumps({**body("chat", text(301, 300), 1500), "stream": True}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.status
            deadline = time.time() + 20
            while newest_running(target) != "chat":
                assert time.time() < deadline, lora_sets(target)
                resp.read1(65536)
            until = time.time() + 4 * POLL_MS / 1000
            while time.time() < until:
                resp.read1(65536)
            assert newest_running(target) == "chat", lora_sets(target)
        finally:
            conn.close()
        got = [via_gateway(s, "chat", text(310 + i, 300))[0] for i in range(3)]
    assert got == [target.name] * 3, (default, target.name, got)
