#!/usr/bin/env python3
"""Where a run's requests went and what it cost them, per worker, from its per-request records
(bench/results/<name>/raw/<scenario>/<policy>/load<L>/requests.jsonl).

For each policy of the run at one load: requests, uncached prompt tokens, the prefill seconds
they cost on the engine's timing model, and p50 / p90 TPOT of the requests each worker
served. Workers that took few, long prompts and show a high TPOT are the split between
long-prompt and short-prompt workers that docs/benchmarks.md describes among the known
misses (p90 TPOT at the knee of the trace workloads).

With --placement (Mooncake trace scenarios, run with --set
mock_flags=--enable-prompt-tokens-details so the engines report cached tokens), also splits
the reuse the run lost into placement and eviction: a per-worker LRU of the trace's blocks,
sized so the fleet's modelled hit rate matches the engines' (--lru-blocks, or searched),
says how much of each prompt the chosen worker could have held against the best worker.

Usage: bench/per_worker.py NAME --load L [--scenario S] [--policies a,b] [--placement]
"""

import argparse
import collections
import json
import os
import sys
from collections import OrderedDict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kvbench.paths import trace_path  # noqa: E402  (where the Mooncake traces live)

# The mock's pass model (examples/mock-worker/src/engine.rs `pass_ms`, Dynamo's H100 fit):
# ms = 4.21e-7 t^2 + 0.01518 t + 16.5 + 2 x 4.21e-7 x t x (tokens already in context).
# Prefill runs in chunks of at most max_batched_tokens: the run's, else the preset's 8192.
CHUNK = 8192


def prefill_s(prompt, cached, chunk=CHUNK):
    """Seconds the uncached part of one prompt costs, prefilled alone, chunk by chunk."""
    ms, done = 0.0, cached
    while done < prompt:
        t = min(chunk, prompt - done)
        ms += 4.21e-7 * t * t + 0.01518 * t + 16.5 + 2 * 4.21e-7 * t * done
        done += t
    return ms / 1000.0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def per_worker(recs, chunk=CHUNK):
    by = collections.defaultdict(list)
    for r in recs:
        if r.get("worker") and r.get("status") == 200:
            by[r["worker"]].append(r)
    rows = []
    for w, rs in by.items():
        tp = [r["tpot_sim"] for r in rs if r.get("tpot_sim") is not None]
        unc = sum(r["prompt_tokens"] - (r.get("cached_tokens") or 0) for r in rs)
        work = sum(prefill_s(r["prompt_tokens"], r.get("cached_tokens") or 0, chunk) for r in rs)
        rows.append((w, len(rs), unc, work, pct(tp, 0.5), pct(tp, 0.9)))
    return sorted(rows, key=lambda x: x[3])


def placement(recs, trace, start, block_tokens, lru_blocks):
    """(ceiling, best worker's LRU, chosen worker's LRU, engines) as shares of prompt tokens,
    in dispatch order; trace blocks count only with their whole prefix."""
    lru = collections.defaultdict(OrderedDict)
    seen = set()
    tot = ceil = best = own = act = 0
    for r in sorted(recs, key=lambda r: r["t"]):
        if not r.get("worker") or r.get("status") != 200 or start + r["i"] >= len(trace):
            continue
        h = trace[start + r["i"]]["hash_ids"]
        n = r["prompt_tokens"]

        def held(s, h=h, n=n):
            k = 0
            for x in h:
                if x not in s:
                    break
                k += 1
            return min(k * block_tokens, n)

        per = {w: held(d) for w, d in lru.items()}
        tot += n
        ceil += held(seen)
        best += max(per.values(), default=0)
        own += per.get(r["worker"], 0)
        act += r.get("cached_tokens") or 0
        d = lru[r["worker"]]
        for x in h:
            d[x] = True
            d.move_to_end(x)
        while len(d) > lru_blocks:
            d.popitem(last=False)
        seen.update(h)
    return tuple(v / max(tot, 1) for v in (ceil, best, own, act))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="results folder under bench/results")
    ap.add_argument("--load", required=True, help="the load as run.py names it (load<L>)")
    ap.add_argument("--scenario", help="default: the run's only scenario")
    ap.add_argument("--policies", help="comma-separated [every policy with records at that load]")
    ap.add_argument("--placement", action="store_true", help="split lost reuse (Mooncake traces)")
    ap.add_argument("--lru-blocks", type=int, help="per-worker LRU size in trace blocks [fitted]")
    a = ap.parse_args()
    out = os.path.join(HERE, "results", a.name)
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    scen = a.scenario or next(iter(res["scenarios"]))
    if scen not in res["scenarios"]:
        sys.exit(f"{a.name} has no scenario {scen}: {', '.join(res['scenarios'])}")
    cfg = res["scenarios"][scen]["config"]
    raw = os.path.join(out, "raw", scen)
    pols = a.policies.split(",") if a.policies else sorted(os.listdir(raw)) if os.path.isdir(raw) else []
    trace = None
    if a.placement:
        if not cfg.get("trace"):
            sys.exit(f"{scen} is not a trace replay: --placement needs the trace's blocks")
        with open(trace_path(cfg)) as f:
            trace = [json.loads(line) for line in f]
    found = False
    for pol in pols:
        path = os.path.join(raw, pol, f"load{a.load}", "requests.jsonl")
        if not os.path.exists(path):
            continue
        found = True
        with open(path) as f:
            recs = [json.loads(line) for line in f]
        print(f"{scen} {pol} at {a.load}: worker, requests, uncached prompt tokens, prefill s "
              f"(simulated, alone), TPOT p50 / p90 (simulated s)")
        for w, n, unc, work, p50, p90 in per_worker(recs, cfg.get("max_batched_tokens") or CHUNK):
            print(f"  {w:>6} {n:5d} {unc:10d} {work:8.1f}   {p50:.3f} / {p90:.3f}")
        if trace is not None:
            if not any(r.get("cached_tokens") for r in recs):
                print("  placement: no cached_tokens in the records (run with "
                      "--set mock_flags=--enable-prompt-tokens-details)")
                continue
            bt = cfg.get("block_tokens") or 512
            if a.lru_blocks:
                sizes = [a.lru_blocks]
            else:  # the smallest LRU whose chosen-worker hit rate reaches the engines'
                sizes = [int(cfg["kv_blocks"] * cfg["block_size"] / bt * x / 8) for x in range(4, 25)]
            fit = None
            for size in sizes:
                fit = (size, placement(recs, trace, cfg["start"], bt, size))
                if fit[1][2] >= fit[1][3]:
                    break
            size, (ceil, best, own, act) = fit
            print(f"  placement (LRU {size} blocks of {bt} tokens per worker): ceiling {ceil:.4f}, "
                  f"best worker {best:.4f}, chosen worker {own:.4f}, engines {act:.4f}; lost to "
                  f"eviction {ceil - best:.4f}, to placement {best - own:.4f}")
    if not found:
        sys.exit(f"no requests.jsonl for load {a.load} under {raw}")


if __name__ == "__main__":
    main()
