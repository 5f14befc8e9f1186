#!/usr/bin/env python3
"""kvroute benchmark suite: every routing policy against the same simulated fleet.

For each scenario (bench/scenarios.py), policy and offered load it starts a fresh fleet of mock
workers, the router under test (Envoy with kvroute, Envoy with a built-in lb_policy,
sglang-router, vllm-router, or none for the oracle, which routes inside the load generator),
runs the scenario's workload with examples/loadgen (a slice of a Mooncake trace or a seeded
synthetic workload), then stops everything. All processes listen on random free 127.0.0.1
ports and are stopped on exit, error or Ctrl-C.

Results go to bench/results/<name>/: results.json (every summary, goodput, overhead),
results.md (tables), PNG plots; raw per-request JSONL and logs under raw/ (not committed).

Usage: bench/run.py --preset quick|full [--scenario a,b|all] [--split dev|heldout] [--name NAME]
       [--policies a,b] [--speeds 1,2] [--replicas 1,2,4]
Run it with the bench venv's python (mk/bench.mk does): it needs matplotlib for the plots.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvbench import log  # noqa: E402  (first: it puts scripts/ on the path)
from kvbench.paths import (BUILD, ENVOY, LOADGEN, MOCK, MODEL, NATS, RELAY, ROOT, SGLANG,  # noqa: E402, F401
                           TUNED_WASM, VLLMR, WASM, build_info, trace_path)
from kvbench.procs import Procs, free_port, http, proc_cpu_s  # noqa: E402, F401
import scenarios  # noqa: E402  (the scenario table)
from kvbench.config import (COMMON, OVERHEAD_SIZES, PRESETS, cell_cfg,  # noqa: E402
                            fleet_split, mock_args, overhead_cells, prefill_pool, scenario_config)
from kvbench.policies import (DEFAULT_POLICIES, EVENT_POLICIES, POLICIES, PRECISE_POLICIES,  # noqa: E402
                              TOKENIZE_MAX_FAILED, expand_replicas, parse_label)
from kvbench.stack import resolve_capacity  # noqa: E402
from kvbench.cell import run_cell  # noqa: E402
from kvbench.overhead import run_overhead  # noqa: E402
from kvbench.targets import (REPLICA_TARGET, analyze, annotate, pool_rows, targets,  # noqa: E402, F401
                             unequal_fleets)
from kvbench.goodput import (Runner, bisect_jobs, close_calls, crossing, goodput_result, gp_text,  # noqa: E402, F401
                             meets, p90, per_repeat_text)
from kvbench.stats import LADDER_RUNGS, fmt, stat  # noqa: E402


# ---------------------------------------------------------------- fleet and routers


def pool_note(cfg, policies=()):
    """How results.md names the fleets' prefill pools: the engines' hit rate counts a handed-off
    prompt twice (prefill worker, then the decode worker that receives its KV), so it is not
    comparable with a fleet without one."""
    m = prefill_pool(cfg)
    if m:
        return (f" ({cfg['workers'] - m} decode, {m} a prefill pool (`--role prefill`), kvroute's disaggregation on; "
                "other policies route to the decode workers only, so kvroute had more workers than they did; "
                "hit rates count a handed-off prompt on both sides)")
    if "kvroute-pool" in policies:
        d, m = fleet_split(cfg, "kvroute-pool")
        return (f"; every policy routes over all {cfg['workers']} except kvroute-pool: {d} decode + {m} of the same "
                f"{cfg['workers']} a prefill pool (`--role prefill`, kvroute's disaggregation on; its hit rate counts "
                "a handed-off prompt on both sides)")
    return ""


# ---------------------------------------------------------------- one run


def replicas_markdown(res):
    """Scenario x policy x gateways: hit rate and TTFT p50 / p90 at each load, goodput at the
    main SLO and its ratio to one gateway's; then what the gateways shared."""
    L = []
    for n, s in res["scenarios"].items():
        P = s["policies"]
        if not any("@" in p for p in P):
            continue
        c = s["config"]
        speeds = sorted(c["speeds"])
        slo = f"{c['slo_s']:g}"
        L += ["", f"## Gateway replicas: {n}", "",
              f"Hit rate, TTFT p50 / p90 (simulated s) at each {c['load_name']}, goodput @ TTFT p90 <= {slo} s "
              "(x one gateway's: kvroute-noshare and kvroute-precise-noshare against kvroute and kvroute-precise). "
              "N > 1: N gateways behind one plain Envoy (ROUND_ROBIN over the gateways, request by request).", "",
              "| policy | gateways | " + " | ".join(f"{c['load_name']} {sp:g}: hit | TTFT p50 / p90" for sp in speeds)
              + f" | goodput @ {slo} s | x 1 gateway |",
              "|---|---|" + "---|---|" * len(speeds) + "---|---|"]
        pols = sorted(P, key=lambda p: (SUMMARY_POLICIES.index(parse_label(p)[0].replace("-noshare", ""))
                                        if parse_label(p)[0].replace("-noshare", "") in SUMMARY_POLICIES else 99,
                                        parse_label(p)[1], "-noshare" in p))
        for pol in pols:
            r = P[pol]
            base, k = parse_label(pol)
            cells = []
            for sp in speeds:
                x = r.get("runs", {}).get(f"{sp:g}")
                if not x:
                    cells.append("- | -")
                    continue
                err = "" if x["errors"] == 0 else f" ({x['errors']} err)"
                cells.append(f"{x['hit_rate']:.3f} | {fmt(x['ttft_sim_s']['p50'], 2)} / {fmt(x['ttft_sim_s']['p90'], 2)}{err}")
            g = (r.get("goodput") or {}).get(slo)
            ref = (P.get(base.replace("-noshare", ""), {}).get("goodput") or {}).get(slo)
            ratio = "-"
            if g and ref and ref["value"]:
                ratio = f"{g['value'] / ref['value']:.2f}"
                if ">=" in (g["kind"], ref["kind"]) and not (g["kind"] == ref["kind"] == ">=" and g["lo"] == ref["lo"]):
                    # A lower bound against another load's: no ratio.
                    ratio = "- (bound)" if g["lo"] != ref["lo"] else ratio
                elif g["kind"] == ref["kind"] == ">=":
                    ratio = "1.00 (both bounds)"
            if "error" in r and not r.get("runs"):
                cells = [f"error: {r['error'][:80]}"] + ["-"] * (2 * len(speeds) - 1)
            L.append(f"| {base} | {k} | " + " | ".join(cells) + f" | {gp_text(g)} | {ratio} |")
        rows = []
        for pol in pols:
            for key, x in sorted(P[pol].get("runs", {}).items(), key=lambda kv: float(kv[0])):
                sh = x.get("sharing")
                if not sh:
                    continue
                d = sh.get("peers_delay_us") or {}
                pr = sh.get("relay_propagation_ms") or {}

                def rv(k, sh=sh):
                    return f"{sh[k]:g}" if k in sh else "-"
                rows.append(f"| {pol} | {key} | {'on' if sh['share'] else 'off'} | {sh['peers_sent']:g} | "
                            f"{sh['peers_received']:g} | {sh['peers_dropped']:g} | {sh['peers_errors']:g} | "
                            f"{sh['peers_gone']:g} | {fmt(d.get('p50'), 0)} / {fmt(d.get('p90'), 0)} / "
                            f"{fmt(d.get('p99'), 0)} ({fmt(d.get('mean'), 0)}) | {rv('relay_decisions_published_total')} | "
                            f"{rv('relay_decisions_nats_received_total')} | {rv('relay_decisions_dropped_total')} | "
                            f"{fmt(pr.get('p50'), 1)} / {fmt(pr.get('p90'), 1)} / {fmt(pr.get('p99'), 1)} "
                            f"({fmt(pr.get('mean'), 2)}) |")
        if rows:
            L += ["", "Decision sharing (end of each run, summed over the gateways):", "",
                  f"| cell | {c['load_name']} | sharing | peers sent | peers received | dropped | errors | gone | "
                  "peer delay p50 / p90 / p99 (mean), us | relays published | relays received from NATS | relays "
                  "dropped | relay propagation p50 / p90 / p99 (mean), ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"] + rows + [
                  "", "Envoy stats `kvroute_peers_*` (admin /stats/prometheus; sent: replication messages a "
                  "gateway handed its relay, received: the routing events in the peers' messages it applied, so "
                  "with N gateways about N-1 times sent x events per message; the delay "
                  "histogram's quantiles are the upper bounds of Envoy's default buckets, the mean is exact), kvroute-relay's `kvroute_relay_decision*` "
                  "(propagation: the decision's send time at the peer gateway -> the Update handed to this gateway's "
                  "stream). Per gateway in results.json (`runs.<load>.sharing`)."]
        t = [x for x in s.get("targets") or [] if "gateway" in x["target"]]
        if t:
            L += ["", "Issue 15's targets:", "", "| target | value | reference | status |", "|---|---|---|---|"]
            L += [f"| {x['target']} | {x['value']} | {x['reference']} | **{x['status']}** |" for x in t]
    return L


def ladder_markdown(cfg, res):
    """kvroute's reuse ladder per run (docs/diagnosing.md): each rung's share of the prompt
    tokens of the requests with usage, and the engines' own hit rate beside `served`."""
    rows = []
    for pol, r in res["policies"].items():
        for key, x in sorted(r.get("runs", {}).items(), key=lambda kv: float(kv[0].split("_")[0])):
            lad = x.get("ladder")
            if not lad:
                continue
            rp, un = lad["reported"], lad["unreported"]
            n = rp["prompt"] or 1.0
            q, h = lad.get("engine_queries"), lad.get("engine_hits")
            engine_rate = f"{h / q:.3f}" if q else "-"
            vs_engine = f"{rp['served'] / h:.3f}" if h else "-"
            rows.append(f"| {pol} | {key} | {rp['prompt']:.0f} | "
                        + " | ".join(f"{rp[g] / n:.3f}" for g in LADDER_RUNGS[1:])
                        + f" | {engine_rate} | {vs_engine} | {un['prompt']:.0f} |")
    if not rows:
        return []
    return ["", "### Reuse ladder (kvroute, end of each run)", "",
            f"| policy | {cfg['load_name']} | prompt tokens with usage | workload | fleet | routed | served | "
            "engines' hit rate | served / engines' hits | prompt tokens without usage |",
            "|---|---|---|---|---|---|---|---|---|---|"] + rows + [
            "", "Rungs as shares of the prompt tokens whose engine reported cached tokens (warm-up included): "
            "workload - fleet is the capacity loss, fleet - routed the load-balancing trade, routed - served the "
            "index error (docs/diagnosing.md). The engines' counters cover every request, those without usage too.",
            ""]


def precise_markdown(cfg, res):
    """Per kvroute-tokenize / kvroute-precise run: tokenize calls, the relay stream, the event
    counters of the filter (Envoy stats) and of kvroute-relay (its /metrics), at the run's end."""
    rows = []
    for pol in [p for p in res["policies"] if parse_label(p)[0] in PRECISE_POLICIES]:
        r = res["policies"].get(pol, {})
        for key, x in sorted(r.get("runs", {}).items(), key=lambda kv: float(kv[0])):
            p = x.get("precise")
            if not p:
                continue
            rl = p.get("relay") or {}

            def rv(name, rl=rl):
                return f"{stat(rl, 'kvroute_relay_' + name):g}" if rl else "-"
            share = p.get("tokenize_failed_share")
            live = ("-" if parse_label(pol)[0] not in EVENT_POLICIES else
                    f"{'yes' if p.get('stream_live_seen') else '**no**'} ({fmt(p.get('stream_live_min'), 0)}/"
                    f"{fmt(p.get('stream_live_max'), 0)}/{p.get('stream_live_end', 0):g})")
            rows.append(f"| {pol} | {key} | {p.get('tokenize_ok', 0):g} | {p.get('tokenize_failed', 0):g} | "
                        f"{'-' if share is None else f'{share:.2%}'} | {live} | "
                        f"{p.get('filter_blocks_stored_total', 0):g} / {p.get('filter_blocks_removed_total', 0):g} | "
                        f"{p.get('filter_stream_failures_total', 0):g} | {rv('blocks_stored_total')} / "
                        f"{rv('blocks_removed_total')} | {rv('gaps_repaired_total')} / {rv('gaps_unrepaired_total')} | "
                        f"{rv('engine_restarts_total')} |")
    if not rows:
        return []
    return ["", "### Precise mode and tokenization (end of each run)", "",
            f"| policy | {cfg['load_name']} | tokenize ok | tokenize failed | failed share | stream live "
            "(min/max during run/end) | filter blocks stored / removed | filter stream failures | relay blocks "
            "stored / removed | relay gaps repaired / unrepaired | relay engine restarts |",
            "|---|---|---|---|---|---|---|---|---|---|---|"] + rows + [
            "", "Envoy stats `kvroute_tokenize_{ok,failed}_total` and `kvroute_precise_*` (admin "
            "/stats/prometheus, summed over labels), kvroute-relay's `kvroute_relay_*` (/metrics). A cell fails "
            f"when the stream never went live or more than {TOKENIZE_MAX_FAILED:.0%} of the tokenize calls "
            "failed. Stream live: the gauge's min/max over 1 s samples while loadgen ran, and at the end (1: live). "
            "Every run's "
            "full stat dump is in results.json (`runs.<load>.precise`)."]


SUMMARY_POLICIES = ["kvroute", "kvroute-pool", "kvroute-noshare", "kvroute-precise-noshare", "kvroute-tuned", "kvroute-tokenize", "kvroute-precise", "sglang-cache-aware", "vllm-router-cache-aware", "envoy-round-robin",
                    "envoy-ring-hash", "envoy-least-request", "envoy-random", "envoy-steer-rr",
                    "envoy-steer-rr-buffered", "oracle"]


def row_label(cfg, label):
    """A summary row's policy, with its workers where not every row had the same ones: `kvroute-pool
    (6 + 2 pool)`; with the legacy prefill_workers, kvroute's rows `(6 + 2 pool)`, the others `(6)`."""
    pol = parse_label(label)[0]
    d, m = fleet_split(cfg, pol)
    if not m and not prefill_pool(cfg):
        return label
    return f"{label} ({d} + {m} pool)" if m and pol.startswith("kvroute") else f"{label} ({d})"


def summary_markdown(res):
    """Scenario x policy: TTFT p50 / p90, hit rate and max/mean requests at each load."""
    sc = [(n, s) for n, s in res["scenarios"].items() if s["policies"]]
    if not sc:
        return []
    nl = max(len(s["config"]["speeds"]) for _, s in sc)
    L = ["## Scenarios", "",
         "| scenario | split | KV blocks/worker | reuse ceiling (run / measured) | description |", "|---|---|---|---|---|"]
    for n, s in sc:
        c = s["config"]
        L.append(f"| {n} | {s['split']} ({s['split_label']}) | {c['kv_blocks']} | {fmt(s.get('reuse_ceiling_all'))} / "
                 f"{fmt(s.get('reuse_ceiling'))} | {s['description']} |")
    L += ["", "Reuse ceiling: share of prompt tokens an infinite prefix cache shared by the fleet would serve for "
          "exactly the requests sent (loadgen re-tokenizes every prompt as the mock does and hashes 16-token "
          "blocks), over the whole run (compare with the engines' hit rate, `*`) and after the warm-up.", "",
          "## Summary (TTFT simulated s; hit rate; max/mean requests per worker)", "",
          "| scenario | policy | " + " | ".join(f"load {i + 1} (offered rps) | TTFT p50 / p90 | hit | max/mean"
                                             for i in range(nl)) + " |",
          "|---|---|" + "---|---|---|---|" * nl]
    for n, s in sc:
        c = s["config"]
        pols = sorted(s["policies"], key=lambda p: (SUMMARY_POLICIES.index(parse_label(p)[0])
                                                    if parse_label(p)[0] in SUMMARY_POLICIES else 99, parse_label(p)[1]))
        for pol in pols:
            r = s["policies"][pol]
            cells = []
            for sp in sorted(c["speeds"]):
                x = r.get("runs", {}).get(f"{sp:g}")
                if not x:
                    cells.append(f"{c['load_name']} {sp:g} | - | - | -")
                    continue
                load = f"{c['load_name']} {sp:g} ({x['offered_rps_sim']:.1f})"
                hs = "*" if x.get("hit_rate_source") == "engine" else ""
                err = "" if x["errors"] == 0 else f" ({x['errors']} err)"
                cells.append(f"{load} | {fmt(x['ttft_sim_s']['p50'], 2)} / "
                             f"{fmt(x['ttft_sim_s']['p90'], 2)}{err} | {x['hit_rate']:.3f}{hs} | "
                             f"{x['max_over_mean_requests']:.2f}")
            cells += ["- | - | - | -"] * (nl - len(cells))
            L.append(f"| {n} | {row_label(c, pol)} | " + " | ".join(cells) + " |")
    L += ["", "## Targets (kvroute, default config)", ""]
    if any(s["split"] != "heldout" for _, s in sc):
        L += ["Not the held-out split: the targets are judged on held-out runs; these are for tuning.", ""]
    L += ["| scenario | target | kvroute | reference | status |", "|---|---|---|---|---|"]
    for n, s in sc:
        if not s.get("targets"):
            L.append(f"| {n} | all | kvroute did not run | | **not measured** |")
        for t in s.get("targets") or []:
            L.append(f"| {n} | {t['target']} | {t['value']} | {t['reference']} | **{t['status']}** |")
    st = [t["status"] for _, s in sc for t in s.get("targets") or []]
    # "met (read off the sweep, not bisected)" is met too, and a missed one missed.
    L += ["", f"{sum(x.startswith('met') for x in st)} met, {sum(x.startswith('missed') for x in st)} missed, "
          f"{sum(x.startswith('undecided') for x in st)} undecided, "
          f"{sum(x.startswith('not measured') for x in st)} not measured. Goodput targets compare the "
          "load knob (bisected where the full preset ran it, see each scenario); `undecided`: a bound at the "
          "cap or the floor of the search does not settle it."
          + (" `pool`: kvroute-pool's own rows (its prefill pool is part of the same workers the peers route "
             "over), shown, not judged: the targets are kvroute's without the pool." if "pool" in st else "")
          + (" `not comparable`: kvroute had a prefill pool (`prefill_workers`) its peers did not route to."
             if any(x.startswith("not comparable") for x in st) else "")]
    beat = [f"{n}: {b['policy']} at {b['load']:g}" for n, s in sc for b in s.get("envelope_beaten") or []]
    if beat:
        L += ["", "**The oracle envelope was beaten** (p90 TTFT below the best oracle setting at the same load) by "
              + "; ".join(beat) + "."]
    return L + [""]


def write_markdown(res, path):
    L = [f"# Benchmark results: {res['name']}", "",
         f"Command: `{res['command']}`  ", f"Date: {res['date']}, wall time {res['wall_s']:.0f} s "
         f"({res['wall_s'] / 60:.1f} min), split {res['split']}  ",
         "All times are simulated seconds (wall x speedup); rates are simulated requests/s.", ""]
    b = res.get("builds") or {}
    if b:
        L += ["Builds: " + ", ".join(f"{k} `{os.path.relpath(v['path'], ROOT) if v['path'].startswith(ROOT) else v['path']}` "
                                     f"sha256 {v['sha256'][:12]} ({v['mtime']} UTC)"
                                     for k, v in b.items() if isinstance(v, dict))
              + (f"; tree at {b['git_head'][:7]}" if b.get("git_head") else ""), ""]
    L += summary_markdown(res)
    L += replicas_markdown(res)
    for s in res["scenarios"].values():
        L += scenario_markdown(s["config"], s)
    ov = res.get("overhead")
    if ov:
        L += overhead_markdown(ov)
    if res.get("not_run"):
        L += ["", "## Could not run", ""] + [f"- {k}: {v}" for k, v in res["not_run"].items()]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def scenario_markdown(cfg, res):
    if cfg["workload"] == "mooncake":
        wl = (f"Mooncake {cfg['trace']} {cfg['split_label']} (first {cfg['warmup']} not measured), trace blocks "
              f"of 512 tokens replayed as {cfg['block_tokens']}, max_tokens <= {cfg['max_output']}, prompts <= "
              f"{cfg['max_input_tokens']} tokens; load = trace speed factor"
              + (f"; burst `{cfg['burst']}` (loadgen --burst AT:LEN:F)" if cfg.get("burst") else ""))
    else:
        more = (f" (above load {cfg['sessions'] / cfg['window_s']:g}: load x {cfg['window_s']:.3g} s of arrivals)"
                if cfg.get("window_s") else "")
        wl = (f"synthetic, {cfg['split_label']}, {cfg['sessions']} sessions{more} of {cfg['turns'][0]}-{cfg['turns'][1]} "
              f"turns, think {cfg['think_s']:g} s, `{' '.join(cfg['loadgen_args'])}`, max_tokens <= "
              f"{cfg['max_output']} (first {cfg['warmup']} requests not measured); load = new sessions per "
              "simulated second")
    L = ["", f"## Scenario {cfg['scenario']} ({cfg['split']})", "", cfg["description"] + "  ",
         f"Fleet: {cfg['workers']} mock workers{pool_note(cfg, res.get('policies') or ())}, Dynamo timing model, --speedup {cfg['speedup']:g}, "
         f"`{' '.join(mock_args(cfg))}` ({cfg['kv_blocks']} blocks x {cfg['block_size']} tokens of KV each)  ",
         f"Workload: {wl}  ",
         f"Infinite-cache reuse ceiling: {fmt(res.get('reuse_ceiling_all'))} of prompt tokens over the run, "
         f"{fmt(res.get('reuse_ceiling'))} after the warm-up; {res['wall_s']:.0f} s wall"
         + (f" ({res['runs']} runs, sweep {res['sweep_wall_s']:.0f} s)" if res.get("runs") else ""), ""]
    bud = res.get("budget") or {}
    if bud.get("skipped") or bud.get("cut"):
        def jobs_text(js):
            return ", ".join(f"{p} at {s:g} s" for p, s in js) or "none"
        L += [f"Time budget (`budget_min`, this scenario's share {bud['allowance_s']} s): close calls not "
              f"bisected, read off the sweep: {jobs_text(bud['skipped'])}; bisection or repeats cut short "
              f"(the bracket reached): {jobs_text(bud['cut'])}.", ""]
    L += [
         f"### Policies at {cfg['load_name']} {cfg['main_speed']:g} (main point)", "",
         "| policy | ok/req | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p90 | E2E p50 | done rps | hit rate | max/mean req | "
         f"goodput @ TTFT p90 <= {cfg['slo_s']:g} s | preempt | evicted blocks |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in res["table"]:
        if "error" in t:
            L.append(f"| {t['policy']} | could not run: {t['error'][:120]} ||||||||||||")
            continue
        pol = t["policy"] + (f" ({t['oracle_setting']})" if t.get("oracle_setting") else "")
        L.append(f"| {pol} | {t['requests'] - t['errors']}/{t['requests']} | {fmt(t['ttft_p50'])} | "
                 f"{fmt(t['ttft_p90'])} | {fmt(t['ttft_p99'])} | {fmt(t['tpot_p90'], 4)} | {fmt(t['e2e_p50'], 2)} | "
                 f"{t['throughput']:.2f} | {t['hit_rate']:.3f}{'*' if t['hit_rate_source'] == 'engine' else ''} | "
                 f"{t['max_mean']:.2f} | {gp_text(t['goodput'])} | "
                 f"{'-' if t['preemptions'] is None else int(t['preemptions'])} | "
                 f"{'-' if t['evicted_blocks'] is None else int(t['evicted_blocks'])} |")
    L += ["", "Hit rate: cached / prompt tokens from usage.prompt_tokens_details (requests after the warm-up); "
          "`*`: the workers do not report cached_tokens (vLLM's default), so it is the engines' own "
          "vllm:prefix_cache_hits / queries over the whole run. TPOT: (E2E - TTFT) / (output tokens - 1) per "
          "request. preempt: vllm:num_preemptions summed over the fleet; evicted blocks: cached KV blocks the "
          "fleet evicted to make room (mock:kv_evicted_blocks).", ""]
    L += goodput_markdown(cfg, res)
    L += ["", "### Sweep (TTFT p90, simulated s, by offered load)", "",
          "| policy | " + " | ".join(f"{cfg['load_name']} {s:g}" for s in cfg["speeds"]) + " |",
          "|---|" + "---|" * len(cfg["speeds"])]
    for pol, r in res["policies"].items():
        if not r.get("runs"):
            continue
        cells = []
        for s in cfg["speeds"]:
            x = r["runs"].get(f"{s:g}")
            cells.append("-" if not x else f"{fmt(x['ttft_sim_s']['p90'])} @ {x['offered_rps_sim']:.1f} rps"
                         + ("" if x["errors"] == 0 else f" ({x['errors']} err)")
                         + (f" ({x['oracle_setting']})" if x.get("oracle_setting") else ""))
        L.append(f"| {pol} | " + " | ".join(cells) + " |")
    L += envelope_markdown(cfg, res)
    L += precise_markdown(cfg, res)
    L += ladder_markdown(cfg, res)
    L += ["", "### Targets (kvroute, default config)", ""]
    if not res.get("targets"):
        L.append("kvroute did not run on this scenario: no targets.")
    else:
        if res["split"] != "heldout":
            L += [f"Split {res['split']}: the targets are judged on the held-out split; these are for tuning.", ""]
        L += ["| target | kvroute | reference | status |", "|---|---|---|---|"]
        for t in res["targets"]:
            L.append(f"| {t['target']} | {t['value']} | {t['reference']} | **{t['status']}** |")
    return L


def goodput_markdown(cfg, res):
    """Goodput per policy and TTFT SLO, with how it was found."""
    pols = [p for p, r in res["policies"].items() if r.get("goodput")]
    if not pols:
        return []
    L = [f"### Goodput (highest offered load, {cfg['load_name']}, with p90 TTFT <= SLO, p90 TPOT <= "
         f"{cfg['tpot_slo_s']:g} s and < 1 % errors)", "",
         "| policy | " + " | ".join(f"TTFT <= {s:g} s" for s in cfg["slos"]) + " |",
         "|---|" + "---|" * len(cfg["slos"])]
    for pol in pols:
        L.append(f"| {pol} | " + " | ".join(gp_text(res["policies"][pol]["goodput"].get(f"{s:g}"))
                                           for s in cfg["slos"]) + " |")
    L += ["", "Bisected cells: the load of the last run that met the SLO (its offered simulated rps in "
          f"brackets), bisected to {cfg['goodput_tol'] * 100:g} % of the load; `[bracket a-b]` when the probe "
          "budget ran out first; `>= x`: met at every load run, x the highest (bisected: the cap, "
          f"{cfg['goodput_cap']:g}x the highest load of the sweep); `< x`: missed even at x, the lowest load run "
          f"(bisected: the floor, {cfg['goodput_floor']:g}x the lowest of the sweep). `~x (a-b)`: not bisected, "
          "read off the sweep (met at a, missed at b, interpolated crossing x). "
          "`repeats a/b`: the goodput each repeat of the deciding loads gives, when they disagree.", ""]
    rep = []
    for pol in pols:
        for sk, g in res["policies"][pol]["goodput"].items():
            if g and g.get("repeats", 1) > 1:
                parts = [f"{tag} {g[tag]:g}: p90 {g[tag + '_p90_range'][0]:.3f}-{g[tag + '_p90_range'][1]:.3f} s"
                         for tag in ("lo", "hi") if g.get(tag) is not None and g.get(tag + "_p90_range")]
                rep.append(f"| {pol} | {sk} | {g['probes'] or 0} | {g['repeats']} | {'; '.join(parts)} | "
                           f"{per_repeat_text(g)} |")
    if rep:
        L += ["Bisection: probes beyond the sweep and the spread over the repeats of the deciding loads "
              "(lo: last met, hi: first missed).", "",
              "| policy | SLO s | probes | runs per deciding load | p90 TTFT min-max | goodput per repeat |",
              "|---|---|---|---|---|---|"] + rep + [""]
    return L


def envelope_markdown(cfg, res):
    sw = res.get("oracle_sweep")
    if not sw:
        return []
    keys = sorted({k for o in sw.values() for k in o["runs"] if "_r" not in k}, key=float)
    L = ["", "### Oracle envelope (p90 TTFT by setting; the oracle's row is the best at each load)", "",
         "| setting (prefill_scale, held_weight) | " + " | ".join(f"{cfg['load_name']} {k}" for k in keys) + " |",
         "|---|" + "---|" * len(keys)]
    orr = res["policies"].get("oracle", {}).get("runs", {})
    for lab, o in sw.items():
        cells = []
        for k in keys:
            x = o["runs"].get(k)
            won = orr.get(k, {}).get("oracle_setting") == lab
            cells.append("-" if not x else ("**" if won else "") + fmt(p90(x, "ttft_sim_s")) + ("**" if won else ""))
        L.append(f"| {lab} ({o['setting'][0]:g}, {o['setting'][1]:g}) | " + " | ".join(cells) + " |")
    beaten = res.get("envelope_beaten") or []
    L.append("")
    if beaten:
        L.append("**The oracle envelope is beaten** (p90 TTFT below the best oracle setting at the same load): "
                 + "; ".join(f"{b['policy']} at {b['load']:g}: {b['p90']:.3f} s < {b['oracle_p90']:.3f} s "
                             f"({b['oracle_setting']})" for b in beaten) + ".")
    else:
        L.append("No policy beat the oracle envelope's p90 TTFT at any load.")
    return L


def overhead_markdown(ov):
    L = []
    if ov:
        L += ["", "## Overhead (one instant worker, non-streaming, max_tokens 1, 1 client, paths interleaved; wall ms)", "",
              "| path | " + " | ".join(f"{n // 1000}k {kind} p50 / p99" for _, kind, n in overhead_cells())
              + " | rps (100-token prompts, 32 clients) |",
              "|---|" + "---|" * (len(overhead_cells()) + 1)]
        for name, r in ov["targets"].items():
            L.append(f"| {name} | " + " | ".join(f"{r[k]['p50_ms']:.3f} / {r[k]['p99_ms']:.3f}" for k, _, _ in overhead_cells())
                     + f" | {r['saturate']['rps']:.0f} |")
        if "envoy+kvroute" in ov["targets"]:
            a, b = ov["targets"]["envoy+kvroute"], ov["targets"]["envoy"]
            L.append("| kvroute adds | " + " | ".join(
                f"{a[k]['p50_ms'] - b[k]['p50_ms']:+.3f} / {a[k]['p99_ms'] - b[k]['p99_ms']:+.3f}"
                for k, _, _ in overhead_cells()) + " | |")
        if "envoy+extproc" in ov["targets"]:
            a, b = ov["targets"]["envoy+extproc"], ov["targets"]["envoy"]
            L.append("| ext_proc floor adds | " + " | ".join(
                f"{a[k]['p50_ms'] - b[k]['p50_ms']:+.3f} / {a[k]['p99_ms'] - b[k]['p99_ms']:+.3f}"
                for k, _, _ in overhead_cells()) + " | |")
        L += extproc_ratio_markdown(ov)
        for what in ("kvroute", "extproc"):
            if ov.get(f"{what}_error"):
                L.append(f"\n{what} could not run here: {ov[f'{what}_error']}")
    return L


def extproc_ratio_markdown(ov):
    """kvroute against the ext_proc floor, per prompt size: the p50 each adds to Envoy alone
    (warm prompts), the Envoy CPU per request of each path and the picker's own, and the
    ratios (floor / kvroute)."""
    t, cpu = ov["targets"], ov.get("cpu_ms_per_request") or {}
    if "envoy+extproc" not in t or "envoy+kvroute" not in t:
        return []
    L = ["", "kvroute in Envoy against the ext_proc floor (Envoy's ext_proc filter, BUFFERED body, calling a "
         "minimal gRPC endpoint picker on this machine: relay/examples/extproc_picker.rs), warm prompts; "
         "CPU is user+system of each process over the run, per request:", "",
         "| prompt | kvroute adds p50 ms | floor adds p50 ms | latency ratio | Envoy CPU ms/req: alone / kvroute / "
         "ext_proc + picker | CPU ratio (floor / kvroute) |", "|---|---|---|---|---|---|"]
    for n in OVERHEAD_SIZES:
        k = f"warm{n}"
        if k not in t["envoy"]:
            continue
        kv = t["envoy+kvroute"][k]["p50_ms"] - t["envoy"][k]["p50_ms"]
        ep = t["envoy+extproc"][k]["p50_ms"] - t["envoy"][k]["p50_ms"]
        c = {name: (cpu.get(name) or {}).get(str(n)) for name in ("envoy", "envoy+kvroute", "envoy+extproc",
                                                                   "extproc picker")}
        floor = None if c["envoy+extproc"] is None else c["envoy+extproc"] + (c["extproc picker"] or 0.0)
        lat_ratio = f"{ep / kv:.1f}x" if kv > 0 else "-"
        cpu_ratio = f"{floor / c['envoy+kvroute']:.1f}x" if floor and c["envoy+kvroute"] else "-"
        L.append(f"| {n // 1000}k | {kv:+.3f} | {ep:+.3f} | {lat_ratio} | {fmt(c['envoy'])} / "
                 f"{fmt(c['envoy+kvroute'])} / {fmt(c['envoy+extproc'])} + {fmt(c['extproc picker'])} | {cpu_ratio} |")
    return L


def plot(cfg, res, outdir, rawdir, prefix=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {p: r for p, r in res["policies"].items() if "error" not in r}
    main = f"{cfg['main_speed']:g}"
    # TTFT CDF at the main point, from the per-request records.
    fig, ax = plt.subplots(figsize=(8, 5))
    for pol in ok:
        f = os.path.join(rawdir, pol, f"load{main}", "requests.jsonl")
        if not os.path.exists(f):
            continue
        v = []
        with open(f) as fh:
            for line in fh:
                r = json.loads(line)
                if r["i"] >= cfg["warmup"] and r["error"] is None and r["ttft"] is not None:
                    v.append(r["ttft"] * cfg["speedup"])
        v.sort()
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=pol,
                    lw=2.2 if pol.startswith("kvroute") or pol == "oracle" else 1.3)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (simulated s, log)")
    ax.set_ylabel("fraction of requests")
    ax.axvline(cfg["slo_s"], color="grey", ls=":", lw=1)
    ax.set_title(f"TTFT CDF, {cfg['scenario']} ({cfg['split']}), {cfg['load_name']} {main}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, prefix + "ttft_cdf.png"), dpi=110)
    plt.close(fig)

    # Hit rate per policy.
    pols = [p for p in ok if main in ok[p]["runs"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    hr = [ok[p]["runs"][main]["hit_rate"] for p in pols]
    bars = ax.bar(range(len(pols)), hr, color=["C3" if p.startswith("kvroute") else "C2" if p == "oracle" else "C0" for p in pols])
    for b, h in zip(bars, hr):
        ax.text(b.get_x() + b.get_width() / 2, h, f"{h:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(pols)), pols, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prompt-cache hit rate (cached / prompt tokens)")
    ax.set_title(f"Hit rate per policy, {cfg['scenario']}, {cfg['load_name']} {main}")
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, prefix + "hit_rate.png"), dpi=110)
    plt.close(fig)

    # Requests per worker (heat map).
    names = [f"w{i}" for i in range(cfg["workers"])]
    grid = [[ok[p]["runs"][main]["per_worker"].get(n, {}).get("requests", 0) for n in names] for p in pols]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(pols) + 1.5))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color="white" if v < max(map(max, grid)) * 0.6 else "black")
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks(range(len(pols)), [f"{p} ({ok[p]['runs'][main]['max_over_mean_requests']:.2f})" for p in pols], fontsize=8)
    ax.set_title(f"Requests per worker, {cfg['scenario']}, {cfg['load_name']} {main} (max/mean in brackets)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, prefix + "requests_per_worker.png"), dpi=110)
    plt.close(fig)

    # p90 TTFT against offered rate: every run of the sweep and the bisection.
    fig, ax = plt.subplots(figsize=(8, 5))
    for pol, r in ok.items():
        pts = sorted(r["runs"].values(), key=lambda s: s["offered_rps_sim"])
        xs = [s["offered_rps_sim"] for s in pts if s["ttft_sim_s"]["p90"] is not None]
        ys = [s["ttft_sim_s"]["p90"] for s in pts if s["ttft_sim_s"]["p90"] is not None]
        ax.plot(xs, ys, marker="o", label=f"{pol} (goodput {gp_text((r.get('goodput') or {}).get(cfg_slo(cfg)))})",
                lw=2.2 if pol.startswith("kvroute") or pol == "oracle" else 1.3)
    for slo in cfg["slos"]:
        ax.axhline(slo, color="grey", ls=":", lw=1)
        ax.text(ax.get_xlim()[0], slo, f" SLO {slo:g} s", va="bottom", fontsize=7, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("offered request rate (simulated req/s)")
    ax.set_ylabel("TTFT p90 (simulated s, log)")
    ax.set_title(f"TTFT p90 vs. request rate, {cfg['scenario']} (sweep and bisection runs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, prefix + "p90_ttft.png"), dpi=110)
    plt.close(fig)

    # Goodput against the TTFT SLO, one line per policy; hollow markers: not bisected (read off
    # the sweep); ^: a lower bound (met up to the cap); v at 0: missed even at the floor.
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (pol, r) in enumerate(ok.items()):
        gs = [(g["slo"], g) for g in (r.get("goodput") or {}).values() if g]
        if not gs:
            continue
        gs.sort(key=lambda t: t[0])
        col = f"C{i % 10}"
        xs = [x for x, _ in gs]
        ys = [g["value"] for _, g in gs]
        ax.plot(xs, ys, color=col, lw=2.2 if pol.startswith("kvroute") or pol == "oracle" else 1.3, label=pol)
        for x, g in gs:
            mk = "^" if g["kind"] == ">=" else "v" if g["kind"] == "<" else "o"
            ax.plot([x], [g["value"]], marker=mk, color=col, mfc=col if g["method"] == "bisect" else "none", ms=7)
            if g.get("per_repeat") and len(set(g["per_repeat"])) > 1:
                ax.vlines(x, min(g["per_repeat"]), max(g["per_repeat"]), color=col, lw=4, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg["slos"], [f"{x:g}" for x in cfg["slos"]])
    ax.set_xlabel(f"TTFT p90 SLO (simulated s; every SLO also needs p90 TPOT <= {cfg['tpot_slo_s']:g} s)")
    ax.set_ylabel(f"goodput ({cfg['load_name']}: offered load knob)")
    ax.set_title(f"Goodput vs. SLO, {cfg['scenario']} ({cfg['split']}); filled: bisected, hollow: from the sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, prefix + "goodput.png"), dpi=110)
    plt.close(fig)


def cfg_slo(cfg):
    return f"{cfg['slo_s']:g}"


def plot_replicas(cfg, res, outdir, prefix=""):
    """Gateway replicas: hit rate and p90 TTFT at each load, and goodput at the main SLO,
    against the number of gateways, one line per policy (the -noshare lines start from their
    policy's one-gateway cell)."""
    P = res["policies"]
    if not any("@" in p for p in P):
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = {}
    for pol, r in P.items():
        base, n = parse_label(pol)
        if r.get("runs"):
            lines.setdefault(base, {})[n] = r
    for base in list(lines):
        if base.endswith("-noshare") and base[:-len("-noshare")] in lines and 1 in lines[base[:-len("-noshare")]]:
            lines[base].setdefault(1, lines[base[:-len("-noshare")]][1])
    speeds = sorted(cfg["speeds"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    slo = f"{cfg['slo_s']:g}"
    for j, (base, by_n) in enumerate(sorted(lines.items())):
        ns = sorted(by_n)
        col, ls = f"C{j}", "--" if base.endswith("-noshare") else "-"
        for k, sp in enumerate(speeds):
            key = f"{sp:g}"
            pts = [(n, by_n[n]["runs"][key]) for n in ns if key in by_n[n]["runs"]]
            mk = "o" if k == 0 else "s"
            lab = f"{base} ({cfg['load_name']} {sp:g})"
            axes[0].plot([n for n, _ in pts], [x["hit_rate"] for _, x in pts], ls=ls, marker=mk, color=col,
                         alpha=1.0 if k else 0.6, label=lab)
            axes[1].plot([n for n, _ in pts], [p90(x, "ttft_sim_s") for _, x in pts], ls=ls, marker=mk, color=col,
                         alpha=1.0 if k else 0.6, label=lab)
        gs = [(n, (by_n[n].get("goodput") or {}).get(slo)) for n in ns]
        gs = [(n, g["value"]) for n, g in gs if g]
        axes[2].plot([n for n, _ in gs], [v for _, v in gs], ls=ls, marker="o", color=col, label=base)
    axes[0].set_ylabel("hit rate (cached / prompt tokens)")
    axes[1].set_ylabel("p90 TTFT, simulated s")
    axes[1].axhline(cfg["slo_s"], color="grey", ls=":", lw=1)
    axes[2].set_ylabel(f"goodput @ p90 TTFT <= {slo} s ({cfg['load_name']})")
    for ax in axes:
        ax.set_xlabel("gateways")
        ax.set_xticks(sorted({parse_label(p)[1] for p in P}))
    axes[0].legend(fontsize=6)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{cfg['scenario']}: gateway replicas (circles: first load, squares: second; dashed: sharing off)")
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, prefix + "replicas.png"), dpi=110)
    plt.close(fig)


def plot_overhead(res, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ov = res.get("overhead")
    if ov and ov.get("targets"):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        names = list(ov["targets"])
        wdt = 0.8 / len(names)
        for k, name in enumerate(names):
            r = ov["targets"][name]
            cells = overhead_cells()
            xs = [i + k * wdt for i in range(len(cells))]
            ax.bar(xs, [r[key]["p50_ms"] for key, _, _ in cells], wdt, label=f"{name} p50")
            ax.scatter(xs, [r[key]["p99_ms"] for key, _, _ in cells], marker="_", s=200, color="black")
        ax.set_xticks([i + 0.4 - wdt / 2 for i in range(len(cells))], [f"{n // 1000}k {kind}" for _, kind, n in cells],
                      fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("request latency, wall ms (bar p50, tick p99)")
        ax.set_title("Proxy overhead, one instant worker")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "overhead.png"), dpi=110)
        plt.close(fig)


# ---------------------------------------------------------------- main


def run_scenario(cfg, policies, rawdir):
    """One scenario: every policy at every load of the sweep, then (cfg goodput) the bisection
    of the chosen (policy, SLO) pairs and the repeats of their deciding loads, all through one
    cache of runs; returns its results.json section."""
    for pol in policies:
        cell_cfg(cfg, parse_label(pol)[0])  # kvroute-pool with the legacy prefill_workers: refused here
    resolve_capacity(cfg, rawdir)
    sres = {"config": cfg, "description": cfg["description"], "split": cfg["split"],
            "split_label": cfg["split_label"], "policies": {}, "not_run": {}, "bisected": []}
    t0 = time.time()
    run = Runner(cfg, sres, rawdir, run_cell)
    for pol in policies:
        err = None
        for sp in sorted(cfg["speeds"]):
            try:
                run.point(pol, sp)
            except Exception as e:
                err = str(e)
                log(f"{cfg['scenario']} {pol} {cfg['load_name']} {sp:g}: could not run: {err}")
                break
        r = sres["policies"].setdefault(pol, {"runs": {}})
        if err and r["runs"]:
            r["partial_error"] = err
        elif err:
            sres["policies"][pol] = {"error": err}
            sres["not_run"][pol] = err
    sres["sweep_wall_s"] = time.time() - t0
    if cfg["goodput"]:
        jobs = bisect_jobs(cfg, sres)
        # The close calls' bisections are the ones the time budget may skip or cut.
        extra = [j for j in jobs if j not in bisect_jobs(dict(cfg, bisect_close=0), sres)]
        deadline = cfg.get("deadline")
        budget = sres["budget"] = dict(allowance_s=None if deadline is None else round(deadline - t0),
                                       skipped=[], cut=[])

        def over():
            return deadline is not None and time.time() > deadline
        log(f"{cfg['scenario']}: bisecting " + ", ".join(f"{p}@{s:g}s" for p, s in jobs)
            + ("" if deadline is None else f" (close calls while within {deadline - t0:.0f} s)"))
        failed, started, passed_over = set(), set(), set()
        # Twice: a later SLO's probes can reopen an earlier SLO's bracket (a noisy point).
        for _ in range(2):
            for pol, slo in jobs:
                if pol in failed:
                    continue
                optional = (pol, slo) in extra
                try:
                    if optional and over():
                        if (pol, slo) not in started:
                            passed_over.add((pol, slo))
                        continue
                    probes0 = sres["policies"][pol].get("probes", {}).get(f"{slo:g}", 0)
                    done = run.search(pol, slo, over if optional else None)
                    if done or sres["policies"][pol].get("probes", {}).get(f"{slo:g}", 0) > probes0:
                        started.add((pol, slo))
                    if not done:
                        passed_over.add((pol, slo))
                except Exception as e:
                    failed.add(pol)
                    sres["policies"][pol]["bisect_error"] = str(e)
                    log(f"{cfg['scenario']} {pol}: bisection stopped: {e}")
        for pol, slo in jobs:
            if pol not in failed:
                optional = (pol, slo) in extra
                try:
                    if not run.repeat(pol, slo, over if optional else None):
                        passed_over.add((pol, slo))
                except Exception as e:
                    failed.add(pol)
                    sres["policies"][pol]["bisect_error"] = str(e)
                    log(f"{cfg['scenario']} {pol}: repeats stopped: {e}")
        # A close call the budget stopped before its first probe stays read off the sweep;
        # one it stopped later keeps the bracket it reached.
        for j in extra:
            if j in passed_over:
                budget["cut" if j in started else "skipped"].append(list(j))
        sres["bisected"] = [list(j) for j in jobs if list(j) not in budget["skipped"]]
        if budget["skipped"] or budget["cut"]:
            log(f"{cfg['scenario']}: time budget: skipped "
                + (", ".join(f"{p}@{s:g}s" for p, s in budget["skipped"]) or "none") + "; cut short "
                + (", ".join(f"{p}@{s:g}s" for p, s in budget["cut"]) or "none"))
    analyze(cfg, sres)
    annotate(sres)
    sres["wall_s"] = time.time() - t0
    sres["runs"] = sum(len(r.get("runs", {})) + sum(len(v) for v in r.get("repeats", {}).values())
                       for p, r in sres["policies"].items() if p != "oracle") + sum(
        len(o["runs"]) for o in sres.get("oracle_sweep", {}).values())
    return sres


# What the overhead step and the report take after the scenarios (about a minute).
OVERHEAD_RESERVE_S = 90


def scenario_deadline(end, now, rest):
    """When the first of the scenarios `rest` must stop starting close calls: its share of
    the time left until `end`, in proportion to the scenarios' expected times, so a scenario
    that ran short leaves its time to those after it."""
    expected = [scenarios.SCENARIOS[n].get("expected_s", 300) for n in rest]
    return now + max(0.0, end - now) * expected[0] / sum(expected)


def report_only(name):
    outdir = os.path.join(ROOT, "bench", "results", name)
    with open(os.path.join(outdir, "results.json")) as f:
        res = json.load(f)
    for sres in res["scenarios"].values():
        cfg = dict(COMMON, goodput=False, repeats=1, bisect="auto")
        cfg.update(sres["config"])
        sres["config"] = cfg
        analyze(cfg, sres)
        annotate(sres)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(outdir, "results.md"))
    write_plots(res, outdir)


def write_plots(res, outdir):
    rawdir = os.path.join(outdir, "raw")
    try:
        for n, sres in res["scenarios"].items():
            if sres["policies"]:
                plot(sres["config"], sres, outdir, os.path.join(rawdir, n), prefix=f"{n}_")
                plot_replicas(sres["config"], sres, outdir, prefix=f"{n}_")
        plot_overhead(res, outdir)
    except ImportError as e:
        log(f"no plots: {e} (run with build/bench-venv/bin/python)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                    help="quick: two loads per scenario; full: three [quick]")
    ap.add_argument("--scenario", default="conversation",
                    help="comma-separated scenarios, or all, or quick (" + ",".join(scenarios.QUICK) + "); one of: "
                    + ", ".join(scenarios.SCENARIOS) + " [conversation]")
    ap.add_argument("--split", choices=["dev", "heldout"], default="heldout",
                    help="dev: the seed or trace slice to tune on; heldout: the one to report [heldout]")
    ap.add_argument("--name", help="results folder under bench/results [preset name]")
    ap.add_argument("--policies", help="comma-separated, any of: " + ",".join(POLICIES) + " ["
                    + ",".join(DEFAULT_POLICIES) + "]")
    ap.add_argument("--speeds", help="comma-separated offered loads for every scenario run (trace speed factor, "
                    "or new sessions per simulated second for synthetic scenarios; overrides the table)")
    ap.add_argument("--main-speed", type=float)
    ap.add_argument("--replicas", default="1",
                    help="comma-separated gateway counts, e.g. 1,2,4: policies that hold routing state run "
                    "N gateways behind one round-robin Envoy, cells `POLICY@N` (bench/README.md) [1]")
    ap.add_argument("--count", type=int, help="trace requests (Mooncake) or sessions (synthetic)")
    ap.add_argument("--slo", type=float, help="the main p90 TTFT SLO (plots, tables), simulated seconds [2]")
    ap.add_argument("--slos", help="comma-separated p90 TTFT SLOs for goodput, simulated s [0.5,1,2,4]")
    ap.add_argument("--tpot-slo", type=float, help="p90 TPOT every goodput SLO also requires, simulated s [0.1]")
    ap.add_argument("--goodput", action="store_true", default=None,
                    help="bisect goodput (the full preset does; quick reads it off the sweep)")
    ap.add_argument("--no-goodput", dest="goodput", action="store_false", help="full preset without the bisection")
    ap.add_argument("--bisect", help="which policies the goodput bisection runs: auto (kvroute and the best peer "
                    "at each SLO; --set bisect_rr=true adds round-robin at 2 s where the 3x target "
                    "needs it), all, or a comma list [auto]")
    ap.add_argument("--bisect-slos", help="TTFT SLOs the bisection runs at, comma list or all [2]")
    ap.add_argument("--repeats", type=int, help="runs at each deciding load of the bisection [full 2, quick 1]")
    ap.add_argument("--budget-min", type=float, help="wall-clock budget in minutes: close calls' bisections "
                    "stop once a scenario is past its share of it; 0 = none [full 37, quick none]")
    ap.add_argument("--goodput-cap", type=float, help="bracket upward up to this x the highest load [2]")
    ap.add_argument("--oracle-settings", help="the oracle envelope's settings, prefill_scale:held_weight,... "
                    "[1:0.005,1:0.02,1:0.08]")
    ap.add_argument("--tuned", help="JSON merged into the kvroute-tuned plugin config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset or scenario value (numbers parsed as JSON), e.g. --set kv_blocks=4096")
    ap.add_argument("--mock-flags", help="extra mock-worker flags, one string (use --mock-flags=\"--x --y\"), "
                    "e.g. --enable-prompt-tokens-details or --orca-on-stream")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--only-overhead", action="store_true")
    ap.add_argument("--report-only", action="store_true",
                    help="no runs: rewrite results.md and the plots of --name from its results.json")
    a = ap.parse_args()
    if a.report_only:
        return report_only(a.name or a.preset)

    base = dict(PRESETS[a.preset])
    overrides = {}
    if a.speeds:
        overrides["speeds"] = [float(x) for x in a.speeds.split(",")]
    if a.main_speed:
        overrides["main_speed"] = a.main_speed
    if a.slo:
        overrides["slo_s"] = a.slo
    if a.slos:
        overrides["slos"] = [float(x) for x in a.slos.split(",")]
    if a.tpot_slo:
        overrides["tpot_slo_s"] = a.tpot_slo
    if a.goodput is not None:
        overrides["goodput"] = a.goodput
    if a.bisect:
        overrides["bisect"] = a.bisect
    if a.bisect_slos:
        overrides["bisect_slos"] = (None if a.bisect_slos == "all" else [float(x) for x in a.bisect_slos.split(",")])
    if a.repeats:
        overrides["repeats"] = a.repeats
    if a.goodput_cap:
        overrides["goodput_cap"] = a.goodput_cap
    if a.budget_min is not None:
        overrides["budget_min"] = a.budget_min or None
    if a.oracle_settings:
        overrides["oracle_settings"] = [[float(v) for v in x.split(":")] for x in a.oracle_settings.split(",")]
    if a.tuned:
        overrides["tuned"] = json.loads(a.tuned)
    for kv in a.set:
        k, v = kv.split("=", 1)
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    if a.mock_flags is not None:
        overrides["mock_flags"] = a.mock_flags
    names = ([n for n, sc in scenarios.SCENARIOS.items() if not sc.get("by_name_only")] if a.scenario == "all" else list(scenarios.QUICK) if a.scenario == "quick"
             else a.scenario.split(","))
    for n in names:
        if n not in scenarios.SCENARIOS:
            sys.exit(f"unknown scenario {n} (one of: {', '.join(scenarios.SCENARIOS)})")
    policies = a.policies.split(",") if a.policies else list(DEFAULT_POLICIES)
    for pol in policies:
        if pol not in POLICIES:
            sys.exit(f"unknown policy {pol}")
    replicas = sorted({int(x) for x in a.replicas.split(",")})
    if replicas != [1]:
        policies = expand_replicas(policies, replicas)
    name = a.name or a.preset
    outdir = os.path.join(ROOT, "bench", "results", name)
    rawdir = os.path.join(outdir, "raw")
    os.makedirs(rawdir, exist_ok=True)
    for exe in (MOCK, LOADGEN, ENVOY):
        if not os.path.exists(exe):
            sys.exit(f"missing {exe}: run `make bench-deps` first")

    t_start = time.time()
    res = {"name": name, "preset": a.preset, "split": a.split,
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "scenarios": {}, "not_run": {}, "builds": build_info(),
           "replicas": replicas}
    cfgs = {}
    budget_min = overrides.get("budget_min", base.get("budget_min"))
    # The overhead step and the report come after the scenarios, out of the same budget.
    end = None if not budget_min else t_start + 60 * budget_min - (0 if a.no_overhead else OVERHEAD_RESERVE_S)
    if not a.only_overhead:
        for i, n in enumerate(names):
            cfg = scenario_config(base, n, a.split, dict(overrides, **({"count": a.count} if a.count and
                                  scenarios.SCENARIOS[n]["workload"] == "mooncake" else
                                  {"sessions": a.count} if a.count else {})))
            cfg["deadline"] = None if end is None else scenario_deadline(end, time.time(), names[i:])
            sraw = os.path.join(rawdir, n)
            os.makedirs(sraw, exist_ok=True)
            cfgs[n] = cfg
            # A scenario may run a subset of the default policies (time); --policies runs them all.
            pols = policies if a.policies else [p for p in policies if p in scenarios.SCENARIOS[n].get(
                "policies", policies)]
            res["scenarios"][n] = run_scenario(cfg, pols, sraw)
            for pol, err in res["scenarios"][n]["not_run"].items():
                res["not_run"][f"{n}/{pol}"] = err
        if len(names) == 1:
            # One scenario: its results also at the top level, where bench/signals.py and older
            # readers of results.json look.
            only = res["scenarios"][names[0]]
            res.update(config=only["config"], policies=only["policies"], table=only["table"],
                       targets=only["targets"])
    if not a.no_overhead:
        try:
            ocfg = next(iter(cfgs.values()), None)
            if ocfg is None:
                ocfg = scenario_config(base, names[0], a.split, overrides)
                resolve_capacity(ocfg, rawdir)
            wasm_ok = os.path.exists(WASM) and not any(
                p.startswith("kvroute") and "error" in r for s in res["scenarios"].values()
                for p, r in s["policies"].items())
            res["overhead"] = run_overhead(ocfg, rawdir, wasm_ok)
        except Exception as e:
            res["not_run"]["overhead"] = str(e)
            log(f"overhead could not run: {e}")
    res["wall_s"] = time.time() - t_start
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(outdir, "results.md"))
    write_plots(res, outdir)
    log(f"done in {res['wall_s']:.0f} s: {os.path.relpath(outdir, ROOT)}/results.md")
    with open(os.path.join(outdir, "results.md")) as f:
        print(f.read())


if __name__ == "__main__":
    main()
