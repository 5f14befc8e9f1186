"""The whole run bench/run.py asks for: each scenario (every policy at every load of the sweep,
then the goodput bisection and its repeats within the time budget), the overhead step, then
results.json, results.md and the plots in bench/results/<name>/."""

import json
import os
import sys
import time

import scenarios

from kvbench import log, paths
from kvbench.cell import run_cell
from kvbench.config import cell_cfg, scenario_config
from kvbench.goodput import Runner, bisect_jobs
from kvbench.overhead import run_overhead
from kvbench.policies import parse_label
from kvbench.report import write_markdown, write_plots
from kvbench.stack import resolve_capacity
from kvbench.targets import analyze, annotate


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


def run_suite(name, preset, split, base, overrides, names, policies, replicas, command, *, count=None,
              every_policy=False, overhead=True, only_overhead=False):
    """Runs the scenarios `names` for `policies` (cell labels) on the preset `base` with the
    command line's `overrides`, then the overhead step, and writes bench/results/<name>/.
    count: --count (Mooncake requests or synthetic sessions); every_policy: --policies was
    given, so no scenario narrows the set."""
    outdir = os.path.join(paths.ROOT, "bench", "results", name)
    rawdir = os.path.join(outdir, "raw")
    os.makedirs(rawdir, exist_ok=True)
    for exe in (paths.MOCK, paths.LOADGEN, paths.ENVOY):
        if not os.path.exists(exe):
            sys.exit(f"missing {exe}: run `make bench-deps` first")

    t_start = time.time()
    res = {"name": name, "preset": preset, "split": split, "command": command,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "scenarios": {}, "not_run": {}, "builds": paths.build_info(),
           "replicas": replicas}
    cfgs = {}
    budget_min = overrides.get("budget_min", base.get("budget_min"))
    # The overhead step and the report come after the scenarios, out of the same budget.
    end = None if not budget_min else t_start + 60 * budget_min - (OVERHEAD_RESERVE_S if overhead else 0)
    if not only_overhead:
        for i, n in enumerate(names):
            cfg = scenario_config(base, n, split, dict(overrides, **({"count": count} if count and
                                  scenarios.SCENARIOS[n]["workload"] == "mooncake" else
                                  {"sessions": count} if count else {})))
            cfg["deadline"] = None if end is None else scenario_deadline(end, time.time(), names[i:])
            sraw = os.path.join(rawdir, n)
            os.makedirs(sraw, exist_ok=True)
            cfgs[n] = cfg
            # A scenario may leave default policies out (time); --policies runs them all.
            skip = [] if every_policy else scenarios.SCENARIOS[n].get("skip_policies", [])
            pols = [p for p in policies if p not in skip]
            res["scenarios"][n] = run_scenario(cfg, pols, sraw)
            for pol, err in res["scenarios"][n]["not_run"].items():
                res["not_run"][f"{n}/{pol}"] = err
        if len(names) == 1:
            # One scenario: its results also at the top level, where bench/signals.py and older
            # readers of results.json look.
            only = res["scenarios"][names[0]]
            res.update(config=only["config"], policies=only["policies"], table=only["table"],
                       targets=only["targets"])
    if overhead:
        try:
            ocfg = next(iter(cfgs.values()), None)
            if ocfg is None:
                ocfg = scenario_config(base, names[0], split, overrides)
                resolve_capacity(ocfg, rawdir)
            wasm_ok = os.path.exists(paths.WASM) and not any(
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
    log(f"done in {res['wall_s']:.0f} s: {os.path.relpath(outdir, paths.ROOT)}/results.md")
    with open(os.path.join(outdir, "results.md")) as f:
        print(f.read())
