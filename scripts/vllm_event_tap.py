"""Records vLLM engines' KV events with the time each batch arrived, one JSON line per batch:
{"t": arrival, "ts": the engine's own stamp, "w": worker, "e": [["S", hashes, token_ids] |
["R", hashes] | [other tag]]}. Run with vLLM's own Python (pyzmq, msgspec):

    build/vllm-venv/bin/python scripts/vllm_event_tap.py OUT.jsonl NAME=PORT [NAME=PORT ...]

A second subscriber beside kvroute-relay on the engines' PUB sockets, for tests that check a
decision against what the engine did around it (kvstack.VllmEventTap starts and stops it)."""

import json
import sys
import time

import msgspec
import zmq


def simplified(e) -> list:
    """One event as ["S", hashes, token ids], ["R", hashes] or [tag]; vLLM sends array form
    (tag first) or map form (tag under `type`)."""
    if isinstance(e, dict):
        tag, hashes, toks = e.get("type"), e.get("block_hashes"), e.get("token_ids")
    else:
        tag = e[0] if e else None
        hashes = e[1] if len(e) > 1 else None
        toks = e[3] if len(e) > 3 else None
    # Hashes are ints or bytes; their repr is a stable key either way.
    if tag == "BlockStored":
        return ["S", [repr(h) for h in hashes or []], list(toks or [])]
    if tag == "BlockRemoved":
        return ["R", [repr(h) for h in hashes or []]]
    return [tag]


def main() -> None:
    ctx = zmq.Context()
    poller = zmq.Poller()
    names = {}
    for spec in sys.argv[2:]:
        name, port = spec.split("=", 1)
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{port}")
        poller.register(s, zmq.POLLIN)
        names[s] = name
    decode = msgspec.msgpack.Decoder()
    # Created once the sockets are set up: its existence is what VllmEventTap waits for.
    out = open(sys.argv[1], "w")
    while True:
        for s, _ in poller.poll(1000):
            parts = s.recv_multipart()
            t = time.time()
            batch = decode.decode(parts[-1])
            ts, events = (batch.get("ts"), batch.get("events")) if isinstance(batch, dict) else (batch[0], batch[1])
            out.write(json.dumps({"t": t, "ts": ts, "w": names[s], "e": [simplified(e) for e in events or []]}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
