"""Gateway replicas that route as one: two Envoys with kvroute in front of one mock fleet,
each with its own kvroute-relay; the relays share the gateways' decisions over a real
nats-server. A conversation whose turns alternate between the gateways (as a cloud load
balancer spreads them) must keep landing on the worker that holds it, read from the
worker's own `x-worker-id`. Outages of NATS or of a gateway must fail no request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import NATS_SERVER, RELAY, Replicas, Stack, Worker, text  # noqa: E402

pytestmark = pytest.mark.skipif(not (os.path.exists(RELAY) and os.path.exists(NATS_SERVER)),
                                reason="kvroute-relay or nats-server missing (make relay nats)")

CHAT = "/v1/chat/completions"


def fleet(n: int = 4) -> list[Worker]:
    return [Worker(f"decode-{i}", role="decode") for i in range(1, n + 1)]


def chat(g: Stack, messages: list[dict]) -> tuple[str, str]:
    status, headers, data = g.post(CHAT, {"model": "mock-model", "messages": messages, "max_tokens": 8})
    assert status == 200, data[:300]
    reply = json.loads(data)["choices"][0]["message"]["content"]
    return headers["x-worker-id"], reply


def conversations(r: Replicas, n: int, turns: int = 3, pause: float = 0.05) -> float:
    """Share of turns after the first that landed on the worker of the turn before, turns
    alternating between the gateways."""
    same = total = 0
    for c in range(n):
        msgs = [{"role": "system", "content": text(100 + c, 6000)}]
        prev = None
        for t in range(turns):
            msgs.append({"role": "user", "content": f"turn {t} of conversation {c}: " + text(900 + c * 10 + t, 300)})
            worker, reply = chat(r.gateways[(c + t) % len(r.gateways)], msgs)
            msgs.append({"role": "assistant", "content": reply})
            if prev is not None:
                total += 1
                same += worker == prev
            prev = worker
            time.sleep(pause)
    return same / total


def survivors(r: Replicas) -> list[str]:
    """Relay and nats-server processes of `r` still running: its own handles, and any
    process on the machine whose command line names one of its relay or NATS ports."""
    left = [" ".join(p.args) for p in r.processes()
            if p.poll() is None and os.path.basename(str(p.args[0])) in ("kvroute-relay", "nats-server")]
    ports = {str(r.nats.port)} | {str(g.relay.port) for g in r.gateways if g.relay}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[-1].split()[0] == "Z"
        except OSError:
            continue
        cmd = " ".join(argv)
        if zombie or not any(t in cmd for t in ("kvroute-relay", "nats-server")):
            continue
        if any(f":{port}" in a or a == port for a in argv for port in ports) and cmd not in left:
            left.append(cmd)
    return left


def stop_and_check(r: Replicas) -> None:
    r.stop()
    left = survivors(r)
    assert not left, f"still running after Replicas.stop(): {left}"


@pytest.fixture(scope="module")
def replicas():
    r = Replicas(fleet(), n=2, kvroute={"disaggregation": {"threshold_tokens": 0}}).start()
    for g in r.gateways:
        g.wait_relay_live()
    yield r
    stop_and_check(r)


def test_the_next_turn_on_the_other_gateway_lands_on_the_same_worker(replicas):
    shared = conversations(replicas, 12)
    st = replicas.gateways[1].stats()
    assert st.get("kvroute_peers_received_total", 0) > 0, st
    print(f"\nturns on the worker of the previous turn, gateways alternating: sharing on {shared:.0%}")
    assert shared >= 0.9


def test_without_sharing_the_other_gateway_does_not_know_the_conversation():
    r = Replicas(fleet(), n=2, kvroute={"disaggregation": {"threshold_tokens": 0}}, share=False).start()
    try:
        for g in r.gateways:
            g.wait_relay_live()
        alone = conversations(r, 12)
    finally:
        stop_and_check(r)
    print(f"\nturns on the worker of the previous turn, gateways alternating: sharing off {alone:.0%}")
    assert alone < 0.9


def test_a_nats_outage_fails_no_request_and_sharing_resumes(replicas):
    replicas.nats.stop()
    msgs = [{"role": "user", "content": text(5, 2000)}]
    with ThreadPoolExecutor(4) as ex:
        outcomes = list(ex.map(lambda i: chat(replicas.gateways[i % 2], msgs + [
            {"role": "user", "content": f"q{i}"}]), range(40)))
    assert len(outcomes) == 40  # chat() asserts every status is 200
    replicas.nats.start(replicas.dir)
    time.sleep(2.0)  # the relays reconnect on their own
    assert conversations(replicas, 6) >= 0.9


def test_a_gateway_that_dies_leaves_no_phantom_load(replicas):
    a, b = replicas.gateways
    msgs = [{"role": "user", "content": text(7, 4000)}]

    def until(cond, timeout: float = 10.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return True
            time.sleep(0.1)
        return False

    # Long generations through a, in flight when it dies: b charges them too (shared).
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(a.post, CHAT, {"model": "mock-model", "messages": msgs, "max_tokens": 20000},
                          None, 30.0) for _ in range(4)]
        assert until(lambda: b.stats().get("kvroute_active_requests", 0) >= 4), "b never saw a's requests"
        a.envoy.kill()
        for f in futs:
            try:
                f.result(timeout=30)
            except Exception:  # noqa: BLE001 - the gateway died under them, as intended
                pass
    assert until(lambda: b.stats().get("kvroute_peers_gone_total", 0) >= 1), "a was never reported gone"
    assert until(lambda: b.stats().get("kvroute_active_requests", 0) == 0), "b still charges a's requests"
    # b keeps serving.
    chat(b, msgs)
    a.start_envoy(log_name="envoy-0")
    a.wait_relay_live()


def test_stop_leaves_no_relay_or_nats_behind():
    """`Replicas.stop()` once stopped the gateways without their relays: after `make test`,
    four `kvroute-relay --nats` processes were still running."""
    r = Replicas(fleet(2), n=2).start()
    try:
        assert len([p for p in r.processes() if p.poll() is None]) == 2 + 1 + 2 * 2  # workers, nats, envoy+relay each
    finally:
        stop_and_check(r)
