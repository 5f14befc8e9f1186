"""Authentication on the relay's gRPC and on NATS (issue 46), with a real Envoy and the
built filter: precise mode works with the token Envoy passes to the filter; a relay that
demands a token Envoy lacks (or has wrong) refuses the stream with UNAUTHENTICATED, counts it,
and the filter says so in its log and routes on its own predictions; nats-server refuses
clients without the relays' credentials and the relays' user outside the gateways' subjects.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import NATS_SERVER, RELAY, Nats, Stack, Worker  # noqa: E402
from test_precise import post, tokens  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(RELAY), reason="kvroute-relay not built (make relay)")

BLOCK = 16


def precise_stack(envoy_token: str | None = "relay's") -> Stack:
    s = Stack([Worker(f"decode-{i}", role="decode", kv_blocks=4096) for i in (1, 2)],
              kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=2, relay=True)
    if envoy_token != "relay's":
        s.envoy_token = envoy_token
    return s


def relay_log(s: Stack) -> str:
    with open(os.path.join(s.dir, "relay.log"), errors="replace") as f:
        return f.read()


def test_precise_mode_works_with_the_token():
    s = precise_stack().start()
    try:
        assert s.relay.token and len(s.relay.token) >= 16
        s.wait_relay_live()
        doc = tokens(1, 40 * BLOCK)
        first, predicted, _ = post(s, doc)
        assert predicted == 0
        time.sleep(0.2)
        worker, predicted, cached = post(s, doc + tokens(2, 3 * BLOCK))
        assert worker == first and cached >= 39 * BLOCK and abs(predicted - cached) <= BLOCK, (predicted, cached)
        assert s.stats().get("kvroute_precise_blocks_stored_total", 0) >= 40
        m = s.relay.metrics()
        assert m['kvroute_relay_unauthenticated_total{reason="missing"}'] == 0, m
        assert m['kvroute_relay_unauthenticated_total{reason="wrong"}'] == 0, m
        log = relay_log(s)
        assert "gRPC clients must send the relay token (from KVROUTE_RELAY_TOKEN)" in log
        assert s.relay.token not in log and s.relay.token not in s.envoy_log()
        print(f"\nwith the token: live, {s.stats().get('kvroute_precise_blocks_stored_total', 0):.0f} engine blocks "
              f"applied, repeat on {worker} predicted {predicted} cached {cached}, 0 refused")
    finally:
        s.stop()


@pytest.mark.parametrize("envoy_token, reason, says", [
    (None, "missing", "it requires a token and the Wasm VM has none in KVROUTE_RELAY_TOKEN"),
    ("another-token-0123456789abcdef", "wrong", "KVROUTE_RELAY_TOKEN (relay.token_env) holds another token"),
])
def test_a_relay_refuses_a_gateway_without_its_token(envoy_token, reason, says):
    s = precise_stack(envoy_token).start()
    try:
        m: dict = {}
        deadline = time.time() + 10
        while time.time() < deadline:
            m = s.relay.metrics()
            if m.get(f'kvroute_relay_unauthenticated_total{{reason="{reason}"}}', 0) >= 2:
                break
            time.sleep(0.1)
        # Refused and counted, retried with backoff; never live, no engine event applied.
        assert m[f'kvroute_relay_unauthenticated_total{{reason="{reason}"}}'] >= 2, m
        assert m.get("kvroute_relay_streams_open", 0) == 0, m
        assert m.get("kvroute_relay_updates_sent_total", 0) == 0, m
        doc = tokens(3, 40 * BLOCK)
        first, _, _ = post(s, doc)
        time.sleep(0.2)
        # Routed on the filter's own predictions: same worker, cache predicted from the pick.
        worker, predicted, cached = post(s, doc)
        assert worker == first and predicted >= 39 * BLOCK and cached >= 39 * BLOCK
        st = s.stats()
        assert st.get("kvroute_precise_stream_live", 0) == 0, st
        assert st.get("kvroute_precise_blocks_stored_total", 0) == 0, st
        assert st.get("kvroute_precise_stream_failures_total", 0) >= 2, st
        log = s.envoy_log()
        refusals = [line for line in log.splitlines() if "UNAUTHENTICATED" in line]
        assert refusals and says in refusals[0] and "routing on predictions" in refusals[0], log[-3000:]
        assert s.relay.token not in log
        refused = m[f'kvroute_relay_unauthenticated_total{{reason="{reason}"}}']
        print(f"\ntoken {reason}: relay refused {refused:.0f} "
              f"streams, sent 0 updates; filter: {st.get('kvroute_precise_stream_failures_total', 0):.0f} stream "
              f"failures, live 0, repeat on {worker} predicted {predicted} cached {cached}; log: {refusals[0][-160:]}")
    finally:
        s.stop()


def nats_says(port: int, lines: str) -> bytes:
    """What nats-server answers to `lines` (a CONNECT and more) followed by PING."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.recv(4096)  # INFO
        c.sendall(lines.encode() + b"\r\nPING\r\n")
        out = b""
        deadline = time.time() + 3
        while time.time() < deadline and b"PONG" not in out and b"-ERR" not in out:
            try:
                out += c.recv(4096)
            except socket.timeout:
                break
        time.sleep(0.1)
        return out


@pytest.mark.skipif(not os.path.exists(NATS_SERVER), reason="nats-server missing (make nats)")
def test_nats_refuses_clients_without_the_relays_credentials():
    n = Nats().start(tempfile.mkdtemp(prefix="kvroute-e2e-nats-"))
    try:
        relay = json.dumps({"verbose": False, "user": n.user, "pass": n.password})
        assert b"Authorization Violation" in nats_says(n.port, 'CONNECT {"verbose":false}')
        wrong = json.dumps({"verbose": False, "user": n.user, "pass": "guess"})
        assert b"Authorization Violation" in nats_says(n.port, f"CONNECT {wrong}")
        anon_sub = nats_says(n.port, 'CONNECT {"verbose":false}\r\nSUB kvroute.decisions.> 1')
        assert b"Authorization Violation" in anon_sub and b"PONG" not in anon_sub
        # The relays' user: the gateways' subjects, nothing else.
        assert nats_says(n.port, f"CONNECT {relay}\r\nPUB kvroute.decisions.x 1\r\nx").endswith(b"PONG\r\n")
        other = nats_says(n.port, f"CONNECT {relay}\r\nPUB other.subject 1\r\nx")
        assert b"Permissions Violation for Publish" in other
        other = nats_says(n.port, f"CONNECT {relay}\r\nSUB > 1")
        assert b"Permissions Violation for Subscription" in other
    finally:
        n.stop()
