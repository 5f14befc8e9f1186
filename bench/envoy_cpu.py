#!/usr/bin/env python3
"""Envoy's CPU per request with kvroute (or plain round-robin) in front of a small mock fleet.

The benchmark's "router CPU ms/request" mixes a fresh Envoy's start-up (V8 compiling the
filter, every thread taking every replication message for its first 10 s) with the
scenario's own traffic, and moves by +-0.3 ms between runs of one build. This runs one
fixed workload (synthetic chats, loadgen, one seed) against 4 mock workers and prints
Envoy's user+system CPU over the load divided by the requests, so that builds can be
alternated run by run and compared.

Usage: bench/envoy_cpu.py [--wasm build/kvroute.wasm | --round-robin] [--tokens 256]
           [--usage on|off] [--rate 30] [--sessions 300] [--runs 1]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(a, kvstack, loadgen, proc_cpu_s):
    workers = [kvstack.Worker(f"w{i}", kv_blocks=8192) for i in range(4)]
    kv = None if a.round_robin else {"debug_headers": False}
    st = kvstack.Stack(workers, kvroute=kv, speedup=50.0).start()
    try:
        with tempfile.TemporaryDirectory(prefix="envoy-cpu-") as out:
            cmd = [loadgen, "--target", f"http://127.0.0.1:{st.listen}", "--workload", "synthetic",
                   "--sessions", str(a.sessions), "--rate", str(a.rate), "--turns", "1-3",
                   "--think-ms", "100", "--system-prompts", "10", "--system-tokens", "2000",
                   "--user-tokens", "100", "--doc-fraction", "0", "--max-tokens", str(a.tokens),
                   "--stream-usage", a.usage, "--seed", "7", "--model", "mock-model", "--out", out]
            c0, t0 = proc_cpu_s([st.envoy]), time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            c1 = proc_cpu_s([st.envoy])
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
    finally:
        st.stop()
    n = max(1, s["requests"])
    return dict(requests=s["requests"], ok=s.get("ok"), wall_s=round(time.time() - t0, 1),
                envoy_cpu_ms_per_request=round(1e3 * (c1 - c0) / n, 3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wasm", default=os.path.join(ROOT, "build", "kvroute.wasm"))
    ap.add_argument("--round-robin", action="store_true", help="no filter: Envoy's round-robin")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per answer")
    ap.add_argument("--usage", choices=["on", "off"], default="on",
                    help="clients ask for usage in the stream (stream_options.include_usage)")
    ap.add_argument("--rate", type=float, default=30.0, help="new chats per second")
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    # kvstack reads the build to load from the environment when it is imported.
    os.environ["KVROUTE_WASM"] = os.path.abspath(a.wasm)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kvstack  # noqa: E402
    from kvbench.paths import LOADGEN  # noqa: E402
    from kvbench.procs import proc_cpu_s  # noqa: E402
    label = "round-robin" if a.round_robin else os.path.relpath(a.wasm)
    for _ in range(a.runs):
        r = one_run(a, kvstack, LOADGEN, proc_cpu_s)
        print(json.dumps(dict(build=label, tokens=a.tokens, usage=a.usage, rate=a.rate, **r)))


if __name__ == "__main__":
    main()
