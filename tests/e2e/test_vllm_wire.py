"""kvroute-relay against libzmq, which vLLM publishes with (the relay's own ZMQ client and
the mock worker are pure Rust): a vLLM-shaped publisher on pyzmq and msgspec
(fixtures/vllm_publisher.py) with a dropped batch, then a restart of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import RELAY, free_port, request, wait_port  # noqa: E402

zmq = pytest.importorskip("zmq", reason="pyzmq not installed (make nats)")
PUBLISHER = os.path.join(os.path.dirname(__file__), "fixtures", "vllm_publisher.py")
pytestmark = pytest.mark.skipif(not os.path.exists(RELAY), reason="kvroute-relay not built (make relay)")


def health(port: int) -> dict:
    _, _, body = request(port, "GET", "/health")
    return json.loads(body)["engines"][0]


def metric(port: int, name: str) -> float:
    _, _, body = request(port, "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


def until(cond, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_relay_follows_a_libzmq_publisher_through_a_gap_and_a_restart():
    pub, replay, grpc, metrics = free_port(), free_port(), free_port(), free_port()
    logs = tempfile.mkdtemp(prefix="kvroute-wire-")
    relay = subprocess.Popen([RELAY, "--model", "m", "--engine", f"e1=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay}",
                              "--listen", f"127.0.0.1:{grpc}", "--metrics", f"127.0.0.1:{metrics}"],
                             stdout=open(os.path.join(logs, "relay.log"), "wb"), stderr=subprocess.STDOUT)
    try:
        wait_port(metrics, proc=relay)
        # 20 batches, batch 5 never published live: the relay must fetch it by replay.
        first = subprocess.Popen([sys.executable, PUBLISHER, str(pub), str(replay), "20", "1.5", "5"])
        assert until(lambda: health(metrics)["last_seq"] == 19), health(metrics)
        assert metric(metrics, "kvroute_relay_gaps_repaired_total") == 1
        assert metric(metrics, "kvroute_relay_blocks_stored_total") == 20
        assert metric(metrics, "kvroute_relay_blocks_removed_total") == 12
        assert health(metrics)["indexed_blocks"] == 8
        assert metric(metrics, "kvroute_relay_decode_errors_total") == 0
        # Idle, it stays live: the probes of the libzmq ROUTER succeed.
        time.sleep(0.5)
        assert health(metrics)["status"] == "live"
        first.wait(timeout=10)
        # The engine restarts (a new process, sequence from 0, 3 blocks): old blocks go.
        second = subprocess.Popen([sys.executable, PUBLISHER, str(pub), str(replay), "3", "1.5"])
        assert until(lambda: metric(metrics, "kvroute_relay_engine_restarts_total") >= 1)
        assert until(lambda: health(metrics)["indexed_blocks"] == 3), health(metrics)
        second.wait(timeout=10)
    finally:
        relay.kill()
        relay.wait()
