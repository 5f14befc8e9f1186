#!/usr/bin/env python3
"""Paired comparison of kvroute against a variant of its config, over dev seeds or trace windows.

Hit-rate differences between two kvroute settings are often the size of the run-to-run
spread (about +-0.005 on these scenarios), so one run per setting decides nothing. This runs
`kvroute` and `kvroute-tuned` (the default config merged with --tuned) on the same fleet for
each seed (or window), one scenario and load(s), and prints the deltas of each with their mean
and range.

Only dev data: it refuses a scenario's held-out seed (tune on dev, report held-out). A trace
scenario (Mooncake conversation) pairs over windows of the trace instead of seeds, each the
dev slice's length, starting at --starts; a window overlapping the held-out slice is refused.

Usage: bench/paired.py --scenario docqa --speeds 24 --tuned '{"scoring":{"copy_weight":2}}' \\
           --seeds 505,515,525 [--preset full]
       bench/paired.py --scenario conversation --speeds 24,32 --tuned '{...}' --starts 0,800,1200
       bench/paired.py --scenario docqa --speeds 24 --seeds 505,515 --variant-wasm /tmp/new.wasm
           (two builds, each with its default config: KVROUTE_WASM, else build/kvroute.wasm, is
           the baseline)
Results of the last seed or window stay in bench/results/dev-paired/ (not committed).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import scenarios  # noqa: E402

NAME = "dev-paired"
METRICS = [("hit", "hit_rate", "{:+.4f}"), ("ttft p50", ("ttft_sim_s", "p50"), "{:+.3f}"),
           ("ttft p90", ("ttft_sim_s", "p90"), "{:+.3f}"), ("max/mean", "max_over_mean_requests", "{:+.2f}"),
           ("tpot p90", ("tpot_sim_s", "p90"), "{:+.4f}")]


def metric(run, key):
    if isinstance(key, tuple):
        return (run.get(key[0]) or {}).get(key[1])
    return run.get(key)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--speeds", required=True, help="comma-separated loads")
    ap.add_argument("--tuned", default="{}", help="JSON merged into the variant's plugin config")
    ap.add_argument("--variant-wasm", help="the filter build the variant runs (default: the baseline's)")
    ap.add_argument("--seeds", help="comma-separated dev seeds (synthetic scenarios)")
    ap.add_argument("--starts", help="comma-separated first requests of trace windows (trace scenarios)")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed on to run.py for both builds, e.g. --set max_output=1024")
    a = ap.parse_args()
    sc = scenarios.SCENARIOS.get(a.scenario)
    if sc is None:
        sys.exit(f"unknown scenario {a.scenario}")
    if sc.get("workload") == "synthetic":
        if not a.seeds or a.starts:
            sys.exit(f"{a.scenario} is synthetic: pair over --seeds")
        seeds = [int(s) for s in a.seeds.split(",")]
        held = sc.get("heldout", {}).get("seed")
        if held in seeds:
            sys.exit(f"seed {held} is {a.scenario}'s held-out seed: tune on dev seeds only")
        runs = [(f"seed {x}", f"seed={x}") for x in seeds]
    else:
        if not a.starts or a.seeds:
            sys.exit(f"{a.scenario} replays a trace: pair over --starts (trace windows)")
        count = sc["dev"]["count"]
        h0, hn = sc["heldout"]["start"], sc["heldout"]["count"]
        runs = []
        for x in (int(v) for v in a.starts.split(",")):
            if x < h0 + hn and h0 < x + count:
                sys.exit(f"window {x}..{x + count - 1} overlaps the held-out slice "
                         f"{h0}..{h0 + hn - 1}: tune on dev windows only")
            runs.append((f"start {x}", f"start={x}"))
    if a.tuned.strip() in ("", "{}") and not a.variant_wasm:
        sys.exit("nothing to compare: give --tuned, --variant-wasm or both")
    env = dict(os.environ)
    if a.variant_wasm:
        if not os.path.exists(a.variant_wasm):
            sys.exit(f"{a.variant_wasm}: no such file")
        env["KVROUTE_TUNED_WASM"] = os.path.abspath(a.variant_wasm)
    out = os.path.join(HERE, "results", NAME)
    deltas = {}  # (load, metric) -> [delta per seed or window]
    for label_run, setting in runs:
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, os.path.join(HERE, "run.py"), "--preset", a.preset, "--scenario", a.scenario,
               "--split", "dev", "--speeds", a.speeds, "--policies", "kvroute,kvroute-tuned",
               "--tuned", a.tuned, "--set", setting, "--no-goodput", "--no-overhead", "--name", NAME]
        for kv in a.set:
            cmd += ["--set", kv]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"{label_run}: run.py failed\n{p.stdout[-3000:]}")
        with open(os.path.join(out, "results.json")) as f:
            pols = json.load(f)["scenarios"][a.scenario]["policies"]
        base, var = pols["kvroute"]["runs"], pols["kvroute-tuned"]["runs"]
        for load in sorted(base, key=float):
            if load not in var:
                continue
            cells = []
            for label, key, _fmt in METRICS:
                b, v = metric(base[load], key), metric(var[load], key)
                if b is None or v is None:
                    continue
                deltas.setdefault((load, label), []).append(v - b)
                cells.append(f"{label} {b:.3f} -> {v:.3f}")
            print(f"{label_run} load {load}: " + ", ".join(cells), flush=True)
    unit = "seeds" if sc.get("workload") == "synthetic" else "trace windows"
    variant = a.tuned + (f" on {a.variant_wasm}" if a.variant_wasm else "")
    print(f"\n{a.scenario}, variant {variant} minus default, {len(runs)} {unit}:")
    for (load, label), ds in sorted(deltas.items(), key=lambda kv: (float(kv[0][0]), kv[0][1])):
        fmt = next(f for lb, _, f in METRICS if lb == label)
        print(f"  load {load} {label:9}: mean {fmt.format(statistics.mean(ds))}"
              f"  range [{fmt.format(min(ds))} .. {fmt.format(max(ds))}]"
              f"  better in {sum(1 for d in ds if (d > 0) == (label == 'hit') and d != 0)}/{len(ds)}")


if __name__ == "__main__":
    main()
