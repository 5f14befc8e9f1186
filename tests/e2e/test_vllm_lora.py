"""kvroute's LoRA routing in front of real vLLM: two vLLM CPU engines (the tiny model of
scripts/vllm_install.sh) serving two rank-8 adapters written at test time (random, seeded,
torch + safetensors from the vLLM venv: no download) with `--enable-lora --max-loras 2`, and
Envoy with the built filter and its metrics poller on.

Checked against the engines themselves: which engine served a request (`x-worker-id`), what
each engine's `vllm:lora_requests_info` lists, and the adapters' own outputs. Skipped when vLLM
is not installed, except under `make test` (KVROUTE_REQUIRE_VLLM=1)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import (  # noqa: E402
    VLLM_MODEL,
    VLLM_MODEL_DIR,
    VLLM_PYTHON,
    VLLM_SITE,
    Stack,
    VllmWorker,
    prom_samples,
    request,
    start_vllm,
    text,
    vllm_fleet,
    vllm_kvroute,
    vllm_paths,
)

REQUIRED = os.environ.get("KVROUTE_REQUIRE_VLLM", "") not in ("", "0")
pytestmark = pytest.mark.skipif(vllm_paths() is None and not REQUIRED,
                                reason="vLLM not installed (scripts/vllm_install.sh, make vllm)")

ADAPTERS = {"sql": 1, "chat": 2}  # name: seed of its weights
MAX_LORAS = 2
POLL_MS = 250
COMPLETIONS = "/v1/completions"

# A PEFT-layout LoRA of rank 8 on q_proj and v_proj of every layer, weights large enough that
# greedy outputs differ from the base model's.
WRITE_ADAPTER = r"""
import json, sys, torch
from safetensors.torch import save_file
out, seed, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = json.load(open(model + "/config.json"))
h, r = cfg["hidden_size"], 8
kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
g = torch.Generator().manual_seed(seed)
t = {}
for i in range(cfg["num_hidden_layers"]):
    for m, o in (("q_proj", h), ("v_proj", kv)):
        p = f"base_model.model.model.layers.{i}.self_attn.{m}"
        t[p + ".lora_A.weight"] = (torch.randn(r, h, generator=g) * 0.1).to(torch.bfloat16)
        t[p + ".lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.1).to(torch.bfloat16)
save_file(t, out + "/adapter_model.safetensors")
json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16, "lora_dropout": 0.0,
           "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": model},
          open(out + "/adapter_config.json", "w"))
"""


def write_adapters(d: str) -> dict[str, str]:
    paths = {}
    for name, seed in ADAPTERS.items():
        p = os.path.join(d, "adapters", name)
        os.makedirs(p)
        subprocess.run([VLLM_PYTHON, "-c", WRITE_ADAPTER, p, str(seed), VLLM_MODEL_DIR], check=True, timeout=120)
        paths[name] = p
    return paths


@pytest.fixture(scope="module")
def fleet():
    if vllm_paths() is None:
        pytest.fail("vLLM is not installed: make vllm (scripts/vllm_install.sh)")
    d = tempfile.mkdtemp(prefix="kvroute-vllm-lora-")
    paths = write_adapters(d)
    args = ["--enable-lora", "--lora-modules", *[f"{n}={p}" for n, p in paths.items()],
            "--max-loras", str(MAX_LORAS), "--max-lora-rank", "8"]
    workers = vllm_fleet(2, kv_blocks=64)
    for w in workers:
        w.args = list(args)
    t0 = time.time()
    start_vllm(workers, d)
    print(f"\n2 vLLM engines with LoRA healthy in {time.time() - t0:.0f} s; logs in {d}")
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()
        for w in workers:
            assert w.proc is None or w.proc.poll() is not None


@contextmanager
def gateway(workers: list[VllmWorker]):
    """A fresh Envoy + kvroute (its own adapter table) with the metrics poller on; one Envoy
    thread and a fixed seed: equal costs are broken alike in every such gateway."""
    cfg = vllm_kvroute(poll_ms=POLL_MS, debug_headers=True, seed=7, models=[VLLM_MODEL, *ADAPTERS],
                       lora={"adapters": list(ADAPTERS), "max_loras": MAX_LORAS, "load_ms": 50})
    s = Stack(workers, kvroute=cfg, site=dict(VLLM_SITE), concurrency=1)
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


def test_an_adapter_stays_on_the_engine_that_loaded_it(fleet):
    """(b) Requests for `sql` (distinct prompts, no prefix affinity) all go to the engine that
    loaded it first while it has a slot; the other engine never runs `sql` (its own metric)."""
    with gateway(fleet) as s:
        got = [via_gateway(s, "sql", text(100 + i, 300))[0] for i in range(6)]
    assert len(set(got)) == 1, got
    other = next(w for w in fleet if w.name != got[0])
    mine = next(w for w in fleet if w.name == got[0])
    assert any("sql" in k for k in lora_sets(mine)), lora_sets(mine)
    assert not any("sql" in k for k in lora_sets(other)), lora_sets(other)


def test_answers_are_the_adapters_own(fleet):
    """(c) Through the gateway every model answers 200 with its own output: each adapter's
    greedy text differs from the base model's and the other adapter's, and equals what an
    engine serving that adapter directly answers."""
    prompt = text(7, 200)
    with gateway(fleet) as s:
        out = {m: via_gateway(s, m, prompt, max_tokens=8) for m in [VLLM_MODEL, *ADAPTERS]}
    texts = {m: r["choices"][0]["text"] for m, (_, r) in out.items()}
    assert all(r["model"] == m for m, (_, r) in out.items()), {m: r["model"] for m, (_, r) in out.items()}
    assert len(set(texts.values())) == 3, texts
    for m in ADAPTERS:
        for w in fleet:
            assert direct(w, m, prompt, max_tokens=8)["choices"][0]["text"] == texts[m], (m, w.name)


def test_the_poller_reads_real_vllm_lora_metric(fleet):
    """(a) `chat` runs on the engine a fresh gateway does not pick (the same seed picks the same
    engine again without the poller: checked), sent there directly; the next gateway's poller
    reads it from that engine's `vllm:lora_requests_info` and its `chat` requests go there."""
    with gateway(fleet) as s:
        default = via_gateway(s, "chat", text(300, 300))[0]
    target = next(w for w in fleet if w.name != default)
    with gateway(fleet) as s:
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
