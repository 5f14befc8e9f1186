"""Where the suite finds its binaries (each overridable from the environment), the Mooncake
traces, and the record of which builds a run measured."""

import hashlib
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build")
ENVOY = os.path.join(ROOT, ".venv", "bin", "envoy")  # the project venv (make venv)
SGLANG = os.path.join(BUILD, "sglang-venv", "bin", "sglang-router")
VLLMR = os.path.join(BUILD, "vllmr-venv", "bin", "vllm-router")
MOCK = os.path.join(ROOT, "target", "release", "mock-worker")
# Precise mode's kvroute-relay: KVROUTE_RELAY, else `make relay`'s build (its unwinding profile),
# else a release build. It must speak the same relay protocol as the filter (WASM): pin both
# (KVROUTE_WASM, KVROUTE_RELAY) to copies while the tree is being worked on; results.json
# records the sha256 of each (`builds`).
RELAY = os.environ.get("KVROUTE_RELAY") or next(
    (p for p in (os.path.join(ROOT, "target", "relay", "kvroute-relay"),
                 os.path.join(ROOT, "target", "release", "kvroute-relay")) if os.path.exists(p)),
    os.path.join(ROOT, "target", "release", "kvroute-relay"))
LOADGEN = os.path.join(ROOT, "target", "release", "loadgen")
# Gateway replicas (--replicas, issue 15): the relays share decisions through one nats-server
# (`make nats` puts it in the project venv).
NATS = os.environ.get("NATS_SERVER") or os.path.join(ROOT, ".venv", "bin", "nats-server")
# KVROUTE_WASM: measure another build of the filter (e.g. an older release) on the same harness.
WASM = os.environ.get("KVROUTE_WASM") or os.path.join(BUILD, "kvroute.wasm")
# KVROUTE_TUNED_WASM: the build kvroute-tuned runs (default WASM), to pair two builds of the
# filter on the same fleet and workload (bench/paired.py --variant-wasm).
TUNED_WASM = os.environ.get("KVROUTE_TUNED_WASM") or WASM
# The model every request names; bench/vllm.py sets the vLLM one (read as paths.MODEL at each call).
MODEL = "mock-model"


def build_info():
    """The binaries this run measures (path, sha256, mtime) and the tree's commit."""
    out = {}
    builds = [("wasm", WASM), ("relay", RELAY), ("mock_worker", MOCK), ("loadgen", LOADGEN)]
    if TUNED_WASM != WASM:
        builds.append(("wasm_tuned", TUNED_WASM))
    for name, path in builds:
        if os.path.exists(path):
            with open(path, "rb") as f:
                h = hashlib.sha256(f.read()).hexdigest()
            out[name] = dict(path=path, sha256=h, mtime=time.strftime("%Y-%m-%d %H:%M:%S",
                                                                     time.gmtime(os.path.getmtime(path))))
    try:
        out["git_head"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    except OSError:
        pass
    return out


def trace_path(cfg):
    for d in [os.path.join(ROOT, "..", "shared", "traces", "mooncake"), "/work/shared/traces/mooncake"]:
        p = os.path.join(d, cfg["trace"])
        if os.path.exists(p):
            return os.path.abspath(p)
    raise RuntimeError(f"trace {cfg['trace']} not found (../shared/traces/mooncake)")
