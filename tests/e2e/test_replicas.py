"""Gateway replicas that route as one: two Envoys with kvroute in front of one mock fleet,
each with its own kvroute-relay; the relays share the gateways' decisions over a real
nats-server. A conversation whose turns alternate between the gateways (as a cloud load
balancer spreads them) must keep landing on the worker that holds it, read from the
worker's own `x-worker-id`. Outages of NATS or of a gateway must fail no request.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import NATS_SERVER, RELAY, Replicas, Stack, Worker, text  # noqa: E402

pytestmark = pytest.mark.skipif(not (os.path.exists(RELAY) and os.path.exists(NATS_SERVER)),
                                reason="kvroute-relay or nats-server missing (make relay nats)")

CHAT = "/v1/chat/completions"


def fleet(n: int = 4) -> list[Worker]:
    return [Worker(f"decode-{i}", role="decode") for i in range(1, n + 1)]


def chat(g: Stack, messages: list[dict], max_tokens: int = 8) -> tuple[str, str]:
    status, headers, data = g.post(CHAT, {"model": "mock-model", "messages": messages, "max_tokens": max_tokens})
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


def test_fifty_conversations_keep_their_worker_through_the_other_gateway_at_idle(replicas):
    """Turn 1 through one gateway, turn 2 through the other as soon as that gateway has turn
    1's decision, nothing else running: every conversation stays on its worker. The first
    turn's end events reach the other gateway a few ms after its answer (tens under load), so
    the second turn found the first still charged there, running and prefilling on its
    worker, and went elsewhere (before: 27 of 50 kept their worker 5 ms after the answer, 0-1
    of 50 at once; mock at 20x speed)."""
    def received(g: Stack) -> float:
        return g.stats().get("kvroute_peers_received_total", 0)

    moved = []
    for c in range(50):
        first, second = (replicas.gateways[c % 2], replicas.gateways[1 - c % 2])
        msgs = [{"role": "user", "content": f"conversation {c}: " + text(5000 + c, 300)}]
        before = received(second)
        w1, reply = chat(first, msgs, max_tokens=32)
        msgs += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": f"thanks; now the second point of {c}, please"}]
        # The next turn as soon as the other gateway has the first turn's decision (on a
        # loaded machine the decision itself can take tens of ms), whatever came after it.
        deadline = time.time() + 2
        while received(second) <= before and time.time() < deadline:
            time.sleep(0.001)
        w2, _ = chat(second, msgs, max_tokens=32)
        if w1 != w2:
            moved.append((c, w1, w2))
    print(f"\n50 two-turn conversations across the gateways: {50 - len(moved)} kept their worker")
    assert not moved, f"moved (conversation, turn 1 worker, turn 2 worker): {moved}"


# A peer gateway's message forged onto NATS (with the relays' own credentials: an insider or
# a stolen password): the protobuf of kvroute-relay's ShareMsg and kvroute's event encoding,
# written by hand here so the test depends on the wire formats, not on our code.
def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(tag: int, payload: bytes) -> bytes:
    return _varint(tag << 3 | 2) + _varint(len(payload)) + payload


def _event(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + struct.pack("<I", len(body)) + body


def _events(*evs: bytes) -> bytes:
    return bytes([2]) + struct.pack("<Q", 0) + b"".join(evs)


NEVER = 2**64 - 1


def _routed(rid: int, worker: int, now_ms: int, blocks: int = 4) -> bytes:
    body = struct.pack("<QQHHIII", rid, now_ms, worker, 0xFFFF, 0, 1, 1000)
    return _event(1, body + struct.pack("<I", blocks) + b"".join(struct.pack("<Q", rid * 100 + i) for i in range(blocks)))


def _failed(worker: int) -> bytes:
    return _event(5, struct.pack("<HQ", worker, NEVER))


def _busy(worker: int) -> bytes:
    return _event(4, struct.pack("<HfIIQ", worker, 1.0, 10_000, 0xFFFFFFFF, NEVER))


class NatsClient:
    """The NATS text protocol over a socket: enough to read a heartbeat and publish."""

    def __init__(self, port: int, user: str, password: str):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        self._line()  # INFO
        opts = {"user": user, "pass": password, "verbose": False, "pedantic": False}
        self.sock.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
        assert self._line().startswith(b"PONG"), "NATS refused the connection"

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self.buf += self.sock.recv(65536)
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def next_message(self, subject: str) -> tuple[str, bytes]:
        self.sock.sendall(f"SUB {subject} 1\r\n".encode())
        while True:
            line = self._line()
            if line.startswith(b"PING"):
                self.sock.sendall(b"PONG\r\n")
            elif line.startswith(b"MSG"):
                parts = line.split()
                return parts[1].decode(), self._read(int(parts[-1]))

    def publish(self, subject: str, payload: bytes) -> None:
        self.sock.sendall(f"PUB {subject} {len(payload)}\r\n".encode() + payload + b"\r\nPING\r\n")
        while not self._line().startswith(b"PONG"):
            pass

    def close(self) -> None:
        self.sock.close()


def _group_of(share_msg: bytes) -> bytes:
    """Field 2 (the group) of a ShareMsg: every heartbeat sends it in clear."""
    i = 0
    while i < len(share_msg):
        key = share_msg[i]
        i += 1
        wire = key & 7
        if wire == 1:
            i += 8
            continue
        n = shift = 0
        while True:
            b = share_msg[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if wire == 2:
            if key >> 3 == 2:
                return share_msg[i:i + n]
            i += n
    raise AssertionError("no group in the heartbeat")


def test_a_forged_peer_message_on_nats_does_not_steer_and_expires_by_the_local_clock():
    """One forged message once steered both gateways (16 of 16 requests to the one worker
    left): three workers failed and reported busy until u64::MAX, 3,000 requests charged in
    one message, requests stamped u64::MAX that never expire."""
    r = Replicas(fleet(), n=2, kvroute={"disaggregation": {"threshold_tokens": 0},
                                        "load": {"request_ttl_ms": 3000}}).start()
    try:
        for g in r.gateways:
            g.wait_relay_live()
        # Each Envoy thread's VM applies events once it routes (before, it keeps a backlog).
        for g in r.gateways:
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda i, g=g: chat(g, [{"role": "user", "content": f"warm {i}"}]), range(16)))
        nc = NatsClient(r.nats.port, r.nats.user, r.nats.password)
        subject, heartbeat = nc.next_message("kvroute.decisions.*")
        group = _group_of(heartbeat)
        victims = (0, 1, 2)  # worker 3 is the one left
        flood = _events(*(_routed(10_000 + i, victims[i % 3], NEVER, blocks=30) for i in range(3000)))
        health = _events(*(_failed(w) for w in victims), *(_busy(w) for w in victims))
        stamped = _events(*(_routed(i, w, NEVER) for i, w in enumerate((0, 1, 2, 3))))
        peer = _field(1, b"forger") + b"".join(_field(2, m) for m in (flood, health, stamped))
        forged = b"\x09" + struct.pack("<Q", random.getrandbits(63)) + _field(2, group) + _field(3, peer)
        assert len(flood) > 800_000  # the probe's 870 KiB
        nc.publish(subject, forged)
        nc.close()

        def stat(g, name):
            return g.stats().get(name, 0)

        def until(cond, timeout: float) -> bool:
            deadline = time.time() + timeout
            while time.time() < deadline and not cond():
                time.sleep(0.05)
            return cond()

        # The active-requests gauge is restated every 250 ms tick.
        assert until(lambda: all(stat(g, "kvroute_peers_capped_total") >= 3000
                                 and stat(g, "kvroute_active_requests") >= 4 for g in r.gateways), 2.0), \
            [g.stats() for g in r.gateways]
        for g in r.gateways:
            assert stat(g, "kvroute_peers_capped_total") == 3000
            assert stat(g, "kvroute_peers_refused_total") == 6
            assert stat(g, "kvroute_peers_clamped_total") == 4
            assert stat(g, "kvroute_active_requests") == 4, "the 4 stamped decisions are data: charged"

        for g in r.gateways:
            with ThreadPoolExecutor(4) as ex:
                workers = list(ex.map(lambda i, g=g: chat(g, [{"role": "user", "content": f"q{i} " + text(i, 200)}])[0],
                                      range(16)))
            spread = Counter(workers)
            print(f"\n16 requests after the forged message: {dict(spread)}")
            assert len(spread) >= 3 and max(spread.values()) <= 10, spread
        # Stamped u64::MAX, charged from the local clock: gone after the 3 s TTL.
        assert until(lambda: not any(stat(g, "kvroute_active_requests") for g in r.gateways), 6.0), \
            [stat(g, "kvroute_active_requests") for g in r.gateways]
    finally:
        stop_and_check(r)


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
