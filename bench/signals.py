#!/usr/bin/env python3
"""kvroute under real vLLM's signals against the mock's old ones: one bench/run.py sweep per
set of mock-worker flags, then a before/after table.

- before:  --orca-on-stream --enable-prompt-tokens-details (what the mock used to send: an
           ORCA load report on every stream and usage.prompt_tokens_details.cached_tokens)
- details: --enable-prompt-tokens-details (what a vLLM user can turn on)
- after:   no flags (vLLM's defaults: ORCA only on non-streaming responses, no cached_tokens)

Policies that read neither signal (round-robin, sglang-router) show the run-to-run noise. The
variants run interleaved (before, details, after, then again for each repeat), so drift in
the machine's load hits all of them alike; the table gives the mean of the repeats and their
range.
Results: bench/results/<name>/<variant>-r<k>/ and bench/results/<name>/results.md.

Usage: bench/signals.py [--name signals] [--policies a,b] [--repeats 2] [-- bench/run.py args]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = [
    ("before", "old mock: ORCA on streams + cached_tokens", "--orca-on-stream --enable-prompt-tokens-details"),
    ("details", "vLLM + --enable-prompt-tokens-details", "--enable-prompt-tokens-details"),
    ("after", "vLLM defaults", ""),
]


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="signals")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--policies", default="kvroute,envoy-round-robin,sglang-cache-aware")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-runs", action="store_true", help="only rebuild the table from earlier runs")
    ap.add_argument("--resume", action="store_true", help="keep runs that already have results")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="after --: more bench/run.py arguments")
    a = ap.parse_args()
    rest = [x for x in a.rest if x != "--"]
    out = os.path.join(ROOT, "bench", "results", a.name)
    res = {key: [] for key, _, _ in VARIANTS}
    for k in range(1, a.repeats + 1):
        for key, _, flags in VARIANTS:
            run = f"{key}-r{k}"
            done = os.path.exists(os.path.join(out, run, "results.json"))
            if not a.skip_runs and not (a.resume and done):
                cmd = [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--preset", a.preset,
                       "--name", f"{a.name}/{run}", "--policies", a.policies, "--no-overhead",
                       f"--mock-flags={flags}"] + rest
                print("[signals]", " ".join(cmd), file=sys.stderr, flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(os.path.join(out, run, "results.json")) as f:
                res[key].append(json.load(f))

    cfg = res["after"][0]["config"]
    main_speed = f"{cfg['main_speed']:g}"
    speeds = [f"{s:g}" for s in cfg["speeds"]]
    policies = list(res["after"][0]["policies"])
    L = [f"# kvroute under vLLM's signals: {a.name}", "",
         f"`bench/signals.py --name {a.name} --preset {a.preset} --policies {a.policies}`"
         + (f" `-- {' '.join(rest)}`" if rest else ""), "",
         "Each column is a full bench/run.py sweep on a fresh fleet (mock-worker "
         f"`--preset {cfg['mock_preset']}`, {cfg['workers']} workers, Mooncake {cfg['trace']} "
         f"requests {cfg['start']}..{cfg['start'] + cfg['count']}); only the mock's flags differ:", ""]
    for key, label, flags in VARIANTS:
        L.append(f"- **{key}** ({label}): `{flags or '(none)'}`")
    L += ["", "Times are simulated seconds; TTFT at the main speed "
          f"{main_speed} ({res['after'][0]['policies'][policies[0]]['runs'][main_speed]['offered_rps_sim']:.1f} rps); "
          "hit rate is the engines' own (vllm:prefix_cache_hits / queries, whole run), the same "
          "measure in every column; goodput is the highest rate of the sweep with p90 TTFT <= "
          f"{cfg['slo_s']:g} s (interpolated); engine lag is how late the workers' passes started "
          "against their schedule, summed (CPU contention on the benchmark machine). Each cell: mean of "
          f"{a.repeats} repeats [min-max]; goodput lists each repeat (none: even the slowest rate missed the SLO).", "",
          "| policy | metric | " + " | ".join(k for k, _, _ in VARIANTS) + " |",
          "|---|---|" + "---|" * len(VARIANTS)]
    rows = [("TTFT p50", lambda r: r["runs"][main_speed]["ttft_sim_s"]["p50"], ".3f"),
            ("TTFT p90", lambda r: r["runs"][main_speed]["ttft_sim_s"]["p90"], ".3f"),
            ("TTFT p99", lambda r: r["runs"][main_speed]["ttft_sim_s"]["p99"], ".3f"),
            ("E2E p50", lambda r: r["runs"][main_speed]["e2e_sim_s"]["p50"], ".2f"),
            ("hit rate", lambda r: r["runs"][main_speed].get("engine_hit_rate"), ".3f"),
            ("max/mean req", lambda r: r["runs"][main_speed]["max_over_mean_requests"], ".2f"),
            ("preemptions", lambda r: r["runs"][main_speed].get("preemptions"), ".0f"),
            ("goodput rps", lambda r: r.get("goodput_interp_rps_sim"), ".2f"),
            ("engine lag s", lambda r: r["runs"][main_speed].get("worker_metrics", {}).get("mock:engine_lag_seconds_total"), ".1f")]
    rows += [(f"TTFT p90 @ speed {s}", lambda r, s=s: r["runs"].get(s, {}).get("ttft_sim_s", {}).get("p90"), ".3f")
             for s in speeds if s != main_speed]
    table = {}
    for pol in policies:
        for name, get, spec in rows:
            cells = []
            for key, _, _ in VARIANTS:
                vals = []
                for rr in res[key]:
                    r = rr["policies"].get(pol, {})
                    try:
                        v = None if "error" in r else get(r)
                    except (KeyError, TypeError):
                        v = None
                    if v is not None or name == "goodput rps":
                        vals.append(v)
                table.setdefault(pol, {}).setdefault(name, {})[key] = vals
                if name == "goodput rps":
                    # One value per repeat: "none" (even the slowest rate missed the SLO) does
                    # not average.
                    cells.append(", ".join("none" if v is None else fmt(v, spec) for v in vals) or "-")
                elif not vals:
                    cells.append("-")
                elif len(vals) == 1:
                    cells.append(fmt(vals[0], spec))
                else:
                    cells.append(f"{fmt(sum(vals) / len(vals), spec)} [{fmt(min(vals), spec)}-{fmt(max(vals), spec)}]")
            L.append(f"| {pol} | {name} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"variants": [dict(key=k, label=lab, mock_flags=fl) for k, lab, fl in VARIANTS],
                   "main_speed": cfg["main_speed"], "repeats": a.repeats, "table": table}, f, indent=1)
    print("\n".join(L))


if __name__ == "__main__":
    main()
