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

The suite itself is the package bench/kvbench/ (kvbench/__init__.py maps its modules); this file
is the command line make calls.

Usage: bench/run.py --preset quick|full [--scenario a,b|all] [--split dev|heldout] [--name NAME]
       [--policies a,b] [--speeds 1,2] [--replicas 1,2,4]
Run it with the bench venv's python (mk/bench.mk does): it needs matplotlib for the plots.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvbench.config import PRESETS  # noqa: E402  (the package puts scripts/ on the path)
from kvbench.goodput import rnd  # noqa: E402
from kvbench.paths import ROOT  # noqa: E402
from kvbench.policies import DEFAULT_POLICIES, POLICIES, expand_replicas  # noqa: E402
from kvbench.report import report_only  # noqa: E402
from kvbench.suite import run_suite  # noqa: E402
import scenarios  # noqa: E402  (the scenario table)


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
        # At the precision runs are keyed by, so the main load names a run that exists.
        overrides["speeds"] = [rnd(float(x)) for x in a.speeds.split(",")]
    if a.main_speed:
        overrides["main_speed"] = rnd(a.main_speed)
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
    command = " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    run_suite(name, a.preset, a.split, base, overrides, names, policies, replicas, command, count=a.count,
              every_policy=bool(a.policies), overhead=not a.no_overhead, only_overhead=a.only_overhead)


if __name__ == "__main__":
    main()
