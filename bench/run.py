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
from kvbench.config import COMMON, PRESETS, cell_cfg, fleet_split, scenario_config  # noqa: E402, F401
from kvbench.policies import DEFAULT_POLICIES, POLICIES, expand_replicas, parse_label  # noqa: E402
from kvbench.stack import resolve_capacity  # noqa: E402
from kvbench.cell import run_cell  # noqa: E402
from kvbench.overhead import run_overhead  # noqa: E402
from kvbench.report import report_only, write_markdown, write_plots  # noqa: E402
from kvbench.report.markdown import pool_note, row_label  # noqa: E402, F401
from kvbench.targets import (REPLICA_TARGET, analyze, annotate, pool_rows, targets,  # noqa: E402, F401
                             unequal_fleets)
from kvbench.goodput import (Runner, bisect_jobs, close_calls, crossing, goodput_result, gp_text,  # noqa: E402, F401
                             meets, p90, per_repeat_text)


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
