"""Latency kvroute adds inside Envoy: the same upstream behind Envoy with and without the
filter, requests alternating between the two, at several prompt sizes.

    .venv/bin/python scripts/overhead.py [requests per size]

The upstream is one mock worker with a huge speedup and max_tokens 1, so its own time is
small and identical for both paths; the difference of the two latency distributions is the
filter (buffering the body, parsing, hashing, lookup, selection, header rewrite).
"""

import http.client
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvstack import Stack, Worker, text  # noqa: E402

SIZES = [("1k", 1024), ("8k", 8192), ("32k", 32768)]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    upstream = Worker("w1", kv_blocks=65536)
    plain = Stack([upstream], kvroute=None, speedup=1000.0, concurrency=1).start()
    routed = Stack([upstream], kvroute={"disaggregation": {"threshold_tokens": 0}}, concurrency=1).start_envoy()
    time.sleep(0.5)
    try:
        conns = {"plain": http.client.HTTPConnection("127.0.0.1", plain.listen, timeout=30),
                 "kvroute": http.client.HTTPConnection("127.0.0.1", routed.listen, timeout=30)}
        print(f"latency added by kvroute (Envoy with vs without the filter, same upstream), {n} requests per size")
        print("| prompt | without p50 ms | with p50 ms | added p50 ms | without p99 ms | with p99 ms | added p99 ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for (label, tokens), warm in [(s, w) for w in (False, True) for s in SIZES]:
            lat = {"plain": [], "kvroute": []}
            doc = text(10_000 + tokens, int(tokens * 4.5))
            for i in range(n + 10):
                # cold: every prompt new (each one adds all its blocks to the index);
                # warm: one document with a new question each time (the usual chat/RAG case).
                prompt = f"{doc} question {i}" if warm else text(i, int(tokens * 4.5))
                body = json.dumps({"model": "mock-model", "prompt": prompt, "max_tokens": 1}).encode()
                for name in (("plain", "kvroute") if i % 2 else ("kvroute", "plain")):
                    c = conns[name]
                    t0 = time.perf_counter()
                    c.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
                    r = c.getresponse()
                    r.read()
                    dt = (time.perf_counter() - t0) * 1000
                    if r.status != 200:
                        raise SystemExit(f"{name}: HTTP {r.status}")
                    if i >= 10:  # warm-up
                        lat[name].append(dt)
            a, b = lat["plain"], lat["kvroute"]
            print(f"| {label} {'warm' if warm else 'cold'} | {pct(a, .5):.3f} | {pct(b, .5):.3f} | {pct(b, .5) - pct(a, .5):+.3f} "
                  f"| {pct(a, .99):.3f} | {pct(b, .99):.3f} | {pct(b, .99) - pct(a, .99):+.3f} |")
    finally:
        routed.stop(workers=False)
        plain.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
