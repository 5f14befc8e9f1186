"""Knob ablation: does each selection-cost term earn its place?

Runs bench/run.py once per (fleet size, repeat, variant) on the held-out split, the variant as
the `kvroute-tuned` policy with one cost term switched off, the shipped defaults as `kvroute`,
and compares every (scenario, load) cell of the variant against the spread of the default's
repeats. A term whose removal moves no cell beyond that spread is a candidate for the cut.

    build/bench-venv/bin/python bench/ablate.py --name ablation \
        [--scenario shared-context,agentic,docqa] [--workers 8,4] [--repeats 2] [--variants all]
    build/bench-venv/bin/python bench/ablate.py --name ablation --report-only

A smaller fleet runs each scenario's loads scaled by workers / 8 (the scenarios' loads are set
for 8 workers), and a synthetic scenario's sessions in proportion, so each run keeps its wall
time and every fleet sits at the same utilisation. Results: bench/results/<name>/ablation.json
(every cell) and results.md (the table); each bench run's own record stays under runs/.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import scenarios  # noqa: E402

# One term off per variant, by the names x-kvroute-costs prints; the values are what turns the
# term off (src/config.rs ScoringConfig: 0 disables, kv_watermark 1 charges memory only past a
# full cache).
VARIANTS = {
    "recompute": {"recompute_weight": 0.0, "recompute_weight_min": 0.0},
    "recompute-growth": {"recompute_weight": 0.0},
    "duplicate+copy": {"duplicate_weight": 0.0, "copy_weight": 0.0},
    "decode": {"decode_weight": 0.0},
    "interference": {"decode_interference": 0.0},
    "memory": {"kv_watermark": 1.0},
    "balance": {"cache_balance": 0.0},
    "share": {"request_ratio": 0.0, "request_ratio_saturated": 0.0},
    "share-saturated": {"request_ratio_saturated": 0.0},
    "share-family": {"request_ratio_family": 0.0},
}
# The cells compared: (label, key in a run's record, quantile); lower is better for all but hit.
# maxmean: the busiest worker's requests over the mean (the hot spots the share term exists for).
METRICS = [("ttft_p90", "ttft_sim_s", "p90"), ("ttft_p50", "ttft_sim_s", "p50"),
           ("tpot_p90", "itl_sim_s", "p90"), ("hit", "hit_rate", None),
           ("maxmean", "max_over_mean_requests", None), ("preempt", "preemptions", None)]
BASE_WORKERS = 8


def run_one(args, name, scenario, workers, policy, plugin):
    sc = scenarios.SCENARIOS[scenario]
    loads = [x * workers / BASE_WORKERS for x in sc["loads"][:2]]
    cmd = [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--preset", "quick", "--scenario", scenario,
           "--split", "heldout", "--policies", policy, "--no-overhead", "--name", name,
           "--speeds", ",".join(f"{x:g}" for x in loads), "--set", f"workers={workers}"]
    if workers != BASE_WORKERS and sc["workload"] == "synthetic":
        cmd += ["--set", f"sessions={max(20, round(sc['sessions'] * workers / BASE_WORKERS))}"]
    if plugin is not None:
        cmd += ["--tuned", json.dumps(plugin)]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:], file=sys.stderr)
        return {"error": f"run.py exited {p.returncode}"}
    return {"cells": cells_of(name, scenario, policy), "wall_s": round(time.time() - t0, 1), "sub": name,
            "policy": policy}


def cells_of(name, scenario, policy):
    """The METRICS of each load from a bench run's record (bench/results/<name>)."""
    with open(os.path.join(ROOT, "bench", "results", name, "results.json")) as f:
        rec = json.load(f)
    runs = rec["scenarios"][scenario]["policies"][policy]["runs"]
    cells = {}
    for load, r in runs.items():
        if "error" in r:
            cells[load] = {"error": r["error"]}
            continue
        cells[load] = {lab: (r[key][q] if q else r[key]) for lab, key, q in METRICS if r.get(key) is not None}
    return cells


def refresh(state):
    """Re-reads every run's cells from its record, so a metric added to METRICS covers runs
    measured before it."""
    for key, r in state["runs"].items():
        if "cells" not in r:
            continue
        workers, scenario, label, rep = key.split("/")
        sub = r.get("sub") or f"{state['name']}/runs/{workers}-{scenario}-{label}-{rep}"
        pol = r.get("policy") or ("kvroute" if label == "default" else "kvroute-tuned")
        try:
            r["cells"] = cells_of(sub, scenario, pol)
        except (OSError, KeyError):
            pass


def measure(args, outdir, state):
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"unknown variant {v} (one of: {', '.join(VARIANTS)})")
    for workers in [int(x) for x in args.workers.split(",")]:
        for rep in range(args.repeats):
            # The default runs first and last in each pass, so drift over the pass shows in its
            # spread, and again with other router seeds: the held-out workload is the same every
            # run, so identical runs agree almost exactly, while any change of decisions (a
            # tie broken the other way) moves a cell's p90 by chance. The seeds' runs measure
            # that, the noise a variant's cell has to clear.
            # (variant, label in the run's key, suffix after the repeat, plugin settings)
            order = [("default", "default", "", None)]
            order += [(v, v, "", {"scoring": VARIANTS[v]}) for v in variants]
            if args.bracket:
                order.append(("default", "default", "b", None))
            order += [("default", f"default-seed{k}", "", {"seed": k}) for k in range(1, args.seeds + 1)]
            for v, label, suffix, plugin in order:
                for scenario in args.scenario.split(","):
                    key = f"{workers}w/{scenario}/{label}/r{rep}{suffix}"
                    if key in state["runs"]:
                        continue
                    sub = f"{args.name}/runs/{workers}w-{scenario}-{label}-r{rep}{suffix}"
                    pol = "kvroute" if plugin is None else "kvroute-tuned"
                    print(f"ablate: {key}", flush=True)
                    state["runs"][key] = dict(run_one(args, sub, scenario, workers, pol, plugin),
                                              workers=workers, scenario=scenario, variant=v, repeat=rep)
                    with open(os.path.join(outdir, "ablation.json"), "w") as f:
                        json.dump(state, f, indent=1)


def net_effects(state):
    """Each variant's net effect over every cell, the cure for counting cells: per latency
    metric the mean log ratio of its value to the defaults' median (as a factor; above 1 is
    slower), for hit rate the mean difference. The noise it must clear: the same figure for
    each default group (first runs, bracketing runs, each router seed; each over the repeats, as a
    variant is) against that median."""
    cells = {}
    for key, r in state["runs"].items():
        for load, c in r.get("cells", {}).items():
            if "error" in c:
                continue
            # A default's runs group like a variant's (the same label over repeats, across
            # every cell), so the noise row compares like with like.
            label = key.split("/")[2] + ("b" if key.endswith("b") else "")
            who = ("default", label) if r["variant"] == "default" else (r["variant"], None)
            cells.setdefault((r["workers"], r["scenario"], load), {}).setdefault(who, []).append(c)
    per = {}
    for by in cells.values():
        base = [c for (v, _), cs in by.items() if v == "default" for c in cs]
        if not base:
            continue
        for (v, key), cs in by.items():
            for lab, *_ in METRICS:
                bs, vs = [b[lab] for b in base if lab in b], [c[lab] for c in cs if lab in c]
                if not (bs and vs):
                    continue
                ref, val = statistics.median(bs), statistics.median(vs)
                if lab == "hit":
                    d = val - ref
                elif ref > 0 and val > 0:
                    d = math.log(val / ref)
                else:
                    continue
                per.setdefault((v, key), {}).setdefault(lab, []).append(d)
    out = {"variants": {}, "noise": {}}
    for (v, _key), by in per.items():
        eff = {lab: (statistics.mean(ds) if lab == "hit" else math.exp(statistics.mean(ds))) for lab, ds in by.items()}
        if v == "default":
            for lab, x in eff.items():
                lo, hi = out["noise"].get(lab, (x, x))
                out["noise"][lab] = (min(lo, x), max(hi, x))
        else:
            out["variants"][v] = eff
    return out


def verdicts(state, tol, hit_tol):
    """Per (workers, scenario, load, metric): the default's range over its runs, each variant's
    median, and whether it is worse/better beyond the range widened by `tol` (relative; hit
    rate: `hit_tol` absolute)."""
    base, var = {}, {}
    for r in state["runs"].values():
        for load, c in r.get("cells", {}).items():
            if "error" in c:
                continue
            for lab, *_ in METRICS:
                if lab not in c:
                    continue
                k = (r["workers"], r["scenario"], load, lab)
                (base if r["variant"] == "default" else var.setdefault(r["variant"], {})).setdefault(k, []).append(c[lab])
    out = {}
    for v, cells in var.items():
        rows = []
        for k, vals in sorted(cells.items()):
            if k not in base:
                continue
            lo, hi = min(base[k]), max(base[k])
            med = statistics.median(vals)
            higher_better = k[3] == "hit"
            slack = tol * max(abs(lo), abs(hi), 1e-9) if not higher_better else hit_tol
            if higher_better:
                worse, better = med < lo - slack, med > hi + slack
            else:
                worse, better = med > hi + slack, med < lo - slack
            rows.append(dict(workers=k[0], scenario=k[1], load=k[2], metric=k[3], base_lo=lo, base_hi=hi,
                             value=med, n=len(vals), worse=worse, better=better))
        out[v] = rows
    return out


def report(state, outdir, tol, hit_tol):
    vd = verdicts(state, tol, hit_tol)
    lines = [f"# Knob ablation: {state['name']}", "",
             f"Command: `{state['command']}`  ",
             f"Started {state['date']}; held-out split; quick preset loads (scaled by workers / 8).  ",
             "Each variant switches one term off (`kvroute-tuned`); the default (`kvroute`) runs at the "
             "start and end of every pass and with router seeds 1..N. A cell is **worse** or **better** when the variant's median is "
             f"outside the default's range over its runs widened by {tol:.0%} (hit rate: {hit_tol:.3f} absolute). "
             "TTFT and TPOT in simulated seconds.", "",
             "| variant | settings | cells worse | cells better | worst cell (variant vs default range) |",
             "|---|---|---:|---:|---|"]
    for v, rows in vd.items():
        worse = [r for r in rows if r["worse"]]
        better = [r for r in rows if r["better"]]

        def gap(r):
            ref = r["base_hi"] if r["metric"] != "hit" else r["base_lo"]
            return abs(r["value"] - ref) / max(abs(ref), 1e-9)
        w = max(worse, key=gap, default=None)
        ws = (f"{w['workers']}w {w['scenario']} @{w['load']} {w['metric']}: {w['value']:.3f} vs "
              f"{w['base_lo']:.3f}-{w['base_hi']:.3f}") if w else "-"
        lines.append(f"| {v} | `{json.dumps(VARIANTS.get(v, {}))}` | {len(worse)} / {len(rows)} | "
                     f"{len(better)} | {ws} |")
    net = net_effects(state)
    labs = [lab for lab, *_ in METRICS]
    lines += ["", "## Net effect over every cell", "",
              "Each latency: the geometric mean over cells of the variant's value over the defaults' median "
              "(above 1: slower without the term); hit: the mean difference. The noise row is the range of "
              "the same figure for each group of the defaults' runs (first, bracketing, each router seed), "
              "each over the repeats as a variant is.", "",
              "| variant | " + " | ".join(labs) + " |", "|---|" + "---:|" * len(labs)]

    def fmt(lab, x):
        return f"{x:+.4f}" if lab == "hit" else f"{x:.3f}"
    if net["noise"]:
        lines.append("| noise (defaults) | " + " | ".join(
            f"{fmt(lab, net['noise'][lab][0])} .. {fmt(lab, net['noise'][lab][1])}" if lab in net["noise"] else "-"
            for lab in labs) + " |")
    for v, eff in net["variants"].items():
        lines.append(f"| {v} | " + " | ".join(fmt(lab, eff[lab]) if lab in eff else "-" for lab in labs) + " |")
    lines += ["", "## Every cell", "",
              "| variant | fleet | scenario | load | metric | default range | variant | |", "|---|---|---|---|---|---|---|---|"]
    for v, rows in vd.items():
        for r in rows:
            mark = "worse" if r["worse"] else "better" if r["better"] else ""
            lines.append(f"| {v} | {r['workers']}w | {r['scenario']} | {r['load']} | {r['metric']} | "
                         f"{r['base_lo']:.3f}-{r['base_hi']:.3f} | {r['value']:.3f} | {mark} |")
    errs = [k for k, r in state["runs"].items() if "error" in r]
    if errs:
        lines += ["", "Runs that failed: " + ", ".join(errs)]
    with open(os.path.join(outdir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(outdir, "verdicts.json"), "w") as f:
        json.dump(vd, f, indent=1)
    print("\n".join(lines[:8 + len(vd)]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="ablation")
    ap.add_argument("--scenario", default=",".join(scenarios.QUICK))
    ap.add_argument("--workers", default="8,4", help="fleet sizes, comma list [8,4]")
    ap.add_argument("--repeats", type=int, default=1, help="passes over all variants per fleet [1]")
    ap.add_argument("--variants", default="all", help="comma list of: " + ",".join(VARIANTS))
    ap.add_argument("--no-bracket", dest="bracket", action="store_false",
                    help="run the default only at the start of each pass, not also at its end")
    ap.add_argument("--seeds", type=int, default=2,
                    help="extra default runs per pass with router seeds 1..N (the noise of changed decisions) [2]")
    ap.add_argument("--tol", type=float, default=0.05, help="relative slack beyond the default's range [0.05]")
    ap.add_argument("--hit-tol", type=float, default=0.003,
                    help="absolute slack on hit rate beyond the default's range [0.003]")
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    outdir = os.path.join(ROOT, "bench", "results", a.name)
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "ablation.json")
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
    else:
        state = {"name": a.name, "command": "bench/ablate.py " + " ".join(sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {}}
    if not a.report_only:
        measure(a, outdir, state)
    refresh(state)
    with open(path, "w") as f:
        json.dump(state, f, indent=1)
    report(state, outdir, a.tol, a.hit_tol)


if __name__ == "__main__":
    main()
