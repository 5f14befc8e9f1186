"""The benchmark suite behind bench/run.py, in layers: a module imports only from those above
it, and the package itself only provides log() and puts scripts/ on the path.

    paths      binaries, environment overrides, the traces, the build record
    config     presets, one scenario's configuration, the fleet's shape (pure)
    policies   the policy table: how each router starts and what it needs (pure)
    stats      Prometheus samples summed, histogram quantiles, one-line texts (pure)
    procs      process groups, http(), wait_until()
    metrics    the counters of workers, Envoys and relays at the end of a run
    stack      fleet, Envoy, kvroute-relay, NATS, the replicas' front, readiness
    peers      sglang-router, vllm-router, Dynamo's KV router, the ext_proc floor
    cell       one (scenario, policy, load, repeat) run -> its summary
    overhead   the proxy-overhead step
    goodput    SLO checks, bracketing, the bisection over a run function, what to bisect
    targets    goodput per policy, the main table and the targets (pure)
    report     results.md and the plots from results.json alone (markdown, plots)
    suite      each scenario (the sweep, the bisection, its repeats), the overhead step, the files

bench/scenarios.py (the scenario table) sits beside the package; scripts/ holds envoyconf (the
Envoy bootstraps) and kvstack (free_port, prom_samples), shared with the tests and `make demo`.
"""

import os
import sys

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)


def log(*a):
    print("[bench]", *a, file=sys.stderr, flush=True)
