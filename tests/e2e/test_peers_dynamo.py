"""Issue 43's bench peers and the ext_proc floor (bench/kvbench/peers.py), on real mock workers:
the ext_proc picker really decides where Envoy sends a request, Dynamo's selection service
(through our glue) routes a repeated prompt to the worker its KV events show holding it and
its booked load returns to zero, and vllm-router's kv_aware answers on the workers' events.

Needs target/relay/examples/extproc_picker (`make extproc-picker`, part of `make test`),
build/dynamo-venv and build/vllmr-venv (bench dependencies, not installed by `make test`:
`make bench-deps` or `make test-peers`); a missing one skips its test, except under
`make test-peers` (KVROUTE_REQUIRE_PEERS=1), where it fails."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from kvbench import paths, peers  # noqa: E402
from kvbench.config import PRESETS  # noqa: E402
from kvbench.policies import POLICY  # noqa: E402
from kvbench.procs import Procs, http  # noqa: E402
from kvbench.stack import check_routes, start_fleet  # noqa: E402

CFG = dict(PRESETS["quick"], block_size=16, kv_blocks=4096)
DOC = "the quarterly report says revenue grew in every region " * 120


REQUIRED = os.environ.get("KVROUTE_REQUIRE_PEERS", "") not in ("", "0")


def need(path: str, what: str, how: str) -> None:
    if not os.path.exists(path):
        (pytest.fail if REQUIRED else pytest.skip)(f"{what}: {path} missing ({how})")


@pytest.fixture
def cell(tmp_path):
    yield str(tmp_path)
    Procs.stop_all()


def worker_of(h):
    return {k.lower(): v for k, v in h.items()}.get("x-worker-id")


def ask(url, prompt, stream=False):
    body = {"model": paths.MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    st, h, b = http("POST", url + "/v1/completions", body, timeout=30)
    assert st == 200, b[:300]
    return worker_of(h)


def test_the_extproc_picker_names_the_worker_envoy_connects_to(cell):
    need(peers.PICKER, "the ext_proc picker is not built", "make extproc-picker")
    ws = start_fleet(CFG, cell, n=2, speedup=1e6)
    envoy, picker, url = peers.start_extproc(CFG, ws, os.path.join(cell, "ep"))
    got = [ask(url, f"question {i}") for i in range(6)]
    # Round-robin in the picker: the workers alternate, whatever Envoy would have chosen.
    assert got[0] in ("w0", "w1")
    assert all(a != b for a, b in zip(got, got[1:])), got
    # A body that is not a JSON object is refused by the picker (it reads the body), and Envoy
    # fails the request instead of sending it anywhere.
    st, h, _ = http("POST", url + "/v1/completions", "not a request")
    assert st >= 500 and worker_of(h) is None


@pytest.mark.parametrize("policy", ["dynamo-kv", "dynamo-approx"])
def test_dynamo_routes_a_repeated_prompt_to_one_worker_and_frees_its_load(cell, policy):
    need(peers.DYNAMO_PY, "Dynamo's KV router (ai-dynamo-runtime) is not installed",
         "a bench dependency: make bench-deps or make test-peers")
    need(peers.GLUE, "dynamo-glue is not built", "make test-peers")
    ws = start_fleet(CFG, cell, n=3, speedup=100, kv_events=POLICY[policy].events)
    procs, url, parts = peers.start(CFG, policy, ws, cell)
    assert set(parts) == {"router", "glue"}
    check_routes(url, procs, policy)
    first = ask(url, DOC + " first")
    time.sleep(0.5)  # the KV events of the first answer reach Dynamo's index
    later = [ask(url, DOC + f" follow-up {i}", stream=i % 2 == 0) for i in range(4)]
    assert later == [first] * 4, (first, later)
    sel = json.load(open(os.path.join(cell, "dynamo.json")))["select_url"]
    toks = json.loads(http("POST", ws[0]["url"] + "/tokenize", {"model": paths.MODEL, "prompt": DOC})[2])["tokens"]
    pick = json.loads(http("POST", sel + "/select", {"token_ids": toks})[2])
    assert pick["overlap"]["longest_matched"] >= len(toks) - 16, pick
    # Every reservation was freed (prefill_complete, then DELETE, after each answer).
    deadline = time.time() + 5
    while True:
        loads = json.loads(http("GET", sel + "/loads")[2])[0]["loads"]
        if all(x["active_requests"] == 0 for x in loads) or time.time() > deadline:
            break
        time.sleep(0.1)
    assert all(x["active_requests"] == 0 for x in loads), loads


def test_vllm_router_kv_aware_runs_on_the_workers_events(cell):
    need(paths.VLLMR, "vllm-router is not installed", "a bench dependency: make bench-deps or make test-peers")
    ws = start_fleet(CFG, cell, n=3, speedup=100, kv_events=True)
    procs, url, _ = peers.start(CFG, peers.KV_AWARE, ws, cell)
    check_routes(url, procs, peers.KV_AWARE)
    first = ask(url, DOC + " first")
    time.sleep(0.5)
    assert [ask(url, DOC + f" follow-up {i}") for i in range(4)] == [first] * 4
