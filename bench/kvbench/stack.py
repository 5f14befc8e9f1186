"""What one cell starts in front of loadgen: the mock-worker fleet, Envoy (kvroute, a built-in
lb_policy, or the steer diagnostics), kvroute-relay, nats-server, the plain Envoy in front of N
gateways, and the checks that each is ready. Every process goes through procs.Procs."""

import dataclasses
import json
import os
import socket
import threading
import time
import urllib.request

import envoyconf

from kvbench import paths
from kvbench.config import mock_args, prefill_pool
from kvbench.metrics import envoy_kvroute_stats
from kvbench.policies import POLICY, steer_rr_filter
from kvbench.procs import Procs, free_port, http, wait_until
from kvbench.stats import stat


def resolve_capacity(cfg, logdir):
    """Fills kv_blocks and block_size from what one mock worker with these flags reports
    (vllm:cache_config_info), so kvroute's config and the tables match the preset (the
    configured capacity: `engine_kv_blocks`, the workers' real one when it differs, is not
    what the router is told)."""
    ws = start_fleet(dict(cfg, engine_kv_blocks=None), logdir, n=1)
    try:
        _, _, b = http("GET", ws[0]["url"] + "/metrics")
        for line in b.decode().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.rindex("}")].split(","))
                cfg["kv_blocks"] = int(labels["num_gpu_blocks"].strip('"'))
                cfg["block_size"] = int(labels["block_size"].strip('"'))
    finally:
        Procs.stop([w["proc"] for w in ws])
    if cfg["kv_blocks"] is None or cfg["block_size"] is None:
        raise RuntimeError("mock-worker did not report vllm:cache_config_info")


def start_fleet(cfg, logdir, n=None, speedup=None, kv_blocks=None, kv_events=False):
    """n mock workers (the scenario's fleet by default, its last prefill_workers a prefill
    pool); kv_events: each publishes vLLM-format KV cache events (PUB and replay ports, for
    kvroute-relay)."""
    pool = 0 if n else prefill_pool(cfg)
    n = n or cfg["workers"]
    ports = [free_port() for _ in range(n)]
    decode_eps = ",".join(f"127.0.0.1:{p}" for p in ports[:n - pool])
    ws = []
    for i, port in enumerate(ports):
        role = "prefill" if i >= n - pool else "both"
        argv = [paths.MOCK, "--host", "127.0.0.1", "--port", str(port), "--name", f"w{i}",
                "--model", paths.MODEL,
                "--speedup", str(speedup or cfg["speedup"])] + mock_args(cfg, kv_blocks)
        if role == "prefill":
            argv += ["--role", "prefill", "--allowed-decode-endpoints", decode_eps]
        w = dict(name=f"w{i}", port=port, url=f"http://127.0.0.1:{port}", role=role)
        if kv_events:
            w.update(kv_events=free_port(), kv_replay=free_port())
            argv += ["--kv-events", f"tcp://127.0.0.1:{w['kv_events']}",
                     "--kv-events-replay", f"tcp://127.0.0.1:{w['kv_replay']}"]
        w["proc"] = Procs.start(argv, os.path.join(logdir, f"w{i}.log"))
        ws.append(w)
    for w in ws:
        wait_until(lambda w=w: (http("GET", w["url"] + "/health")[0] == 200, None), 15,
                   f"worker {w['name']}", [w["proc"]])
    return ws


def kvroute_config(cfg, ws, extra):
    # Debug headers off as shipped: building x-kvroute-costs re-scores every candidate and
    # formats each term, per request. On (`--set kvroute_debug=true`), loadgen records the
    # costs as route_costs in requests.jsonl.
    # kvroute_extra: the scenario's plugin settings (e.g. `lora` for the adapters it serves).
    extra = {"debug_headers": bool(cfg.get("kvroute_debug")), **cfg.get("kvroute_extra", {}), **(extra or {})}
    if cfg.get("metrics_poll_ms"):
        extra["metrics"] = {"poll_ms": int(cfg["metrics_poll_ms"]), "cluster_suffix": "-metrics"}
    return envoyconf.bench_plugin(upstreams(cfg, ws), cfg["block_size"], extra)


def upstreams(cfg, ws):
    return [envoyconf.Upstream(w["name"], "127.0.0.1", w["port"], w.get("role", "both"), kv_blocks=cfg["kv_blocks"])
            for w in ws]


def decode_workers(ws):
    """The workers a request can be answered by: a prefill pool's workers only hand off."""
    return [w for w in ws if w.get("role") != "prefill"]


def start_relay(cfg, ws, logdir, nats=None):
    """kvroute-relay subscribed to the KV events of the workers ws (precise mode; none: it only
    shares decisions) and, with nats (a nats:// URL), sharing decisions over it; returns the
    process, its gRPC port and its metrics URL once /health answers (and NATS is connected)."""
    if not os.path.exists(paths.RELAY):
        raise RuntimeError(f"{paths.RELAY} not built (cargo build --release -p kvroute-relay)")
    port, mport = free_port(), free_port()
    argv = [paths.RELAY, "--model", paths.MODEL, "--block-size", str(cfg["block_size"]),
            "--listen", f"127.0.0.1:{port}", "--metrics", f"127.0.0.1:{mport}"]
    if nats:
        argv += ["--nats", nats]
    for w in ws:
        argv += ["--engine", f"{w['name']}=tcp://127.0.0.1:{w['kv_events']},replay=tcp://127.0.0.1:{w['kv_replay']}"]
    p = Procs.start(argv, os.path.join(logdir, "relay.log"))
    murl = f"http://127.0.0.1:{mport}"
    wait_until(lambda: (http("GET", murl + "/health")[0] == 200, None), 15, "kvroute-relay", [p])
    if nats:
        def connected():
            h = json.loads(http("GET", murl + "/health")[2])
            return h.get("nats") == "connected", f"nats {h.get('nats')}"
        wait_until(connected, 15, "kvroute-relay: NATS", [p])
    return p, port, murl


def start_nats(logdir):
    """nats-server on a free loopback port (the gateways' relays share decisions through it)."""
    if not os.path.exists(paths.NATS):
        raise RuntimeError(f"{paths.NATS} missing (make nats)")
    port = free_port()
    p = Procs.start([paths.NATS, "-a", "127.0.0.1", "-p", str(port)], os.path.join(logdir, "nats.log"))

    def up():
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True, None
    wait_until(up, 15, "nats-server", [p])
    return p, f"nats://127.0.0.1:{port}"


def start_front(cfg, urls, logdir):
    """The cloud load balancer in front of N gateways: a plain Envoy (no kvroute), one
    ROUND_ROBIN cluster of the gateways' listeners; returns the process and its URL."""
    port, admin = free_port(), free_port()
    ups = [envoyconf.Upstream(f"gw{i}", "127.0.0.1", int(u.rsplit(":", 1)[1])) for i, u in enumerate(urls)]
    doc = envoyconf.bootstrap(envoyconf.bench_site(port, admin, paths.WASM), ups, None, "ROUND_ROBIN")
    path = os.path.join(logdir, "front.yaml")
    with open(path, "w") as f:
        f.write(envoyconf.to_yaml(doc))
    p = Procs.start([paths.ENVOY, "-c", path, "--concurrency", str(cfg["envoy_concurrency"]), "--disable-hot-restart",
                     "-l", "warning"], os.path.join(logdir, "front.log"))
    wait_until(lambda: (http("GET", f"http://127.0.0.1:{admin}/ready")[0] == 200, None), 30, "front envoy", [p])
    return p, f"http://127.0.0.1:{port}"


def start_envoy(cfg, policy, ws, logdir, kv_extra=None, relay_port=None):
    """Envoy from scripts/envoyconf.py (bench/envoy/*.yaml show what it writes); returns the
    process, its listener URL and its admin URL. relay_port: kvroute-relay's gRPC port (the
    `kvroute-relay` cluster, precise mode)."""
    port, admin = free_port(), free_port()
    pol = POLICY[policy]
    conf = None
    if pol.router == "steer":
        conf = kvroute_config(cfg, ws, kv_extra)  # for the layout; the filter is replaced below
    wasm = paths.TUNED_WASM if pol.router == "kvroute" and pol.tuned else paths.WASM
    if pol.router == "kvroute":
        if not os.path.exists(wasm):
            raise RuntimeError(f"{wasm} not built (make wasm)")
        conf = kvroute_config(cfg, ws, kv_extra)
    site = envoyconf.bench_site(port, admin, wasm)
    if cfg.get("worker_id_header"):
        # Engines that do not name themselves (vLLM): Envoy adds x-worker-id (bench/vllm.py).
        site = dataclasses.replace(site, worker_id_header=True)
    if cfg.get("envoy_timing_log"):
        site = dataclasses.replace(site, access_log=True, access_log_format=envoyconf.TIMING_LOG_FORMAT)
    if pol.plugin is not None:
        # decode-pool: round-robin over the workers, the cluster the tokenize calls go to.
        site = dataclasses.replace(site, fallback_pool=True)
    if relay_port:
        site = dataclasses.replace(site, relay=("127.0.0.1", relay_port))
    if pol.router == "kvroute" and (conf.get("metrics") or {}).get("cluster_suffix") == "-metrics":
        # The metrics poller (`--set metrics_poll_ms=500`) scrapes each worker through a
        # cluster of that worker alone.
        site = dataclasses.replace(site, metrics_clusters=True)
    doc = envoyconf.bootstrap(site, upstreams(cfg, ws), conf, pol.lb or "ROUND_ROBIN")
    if pol.router == "steer":
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [steer_rr_filter([w["name"] for w in ws], pol.buffered), envoyconf.ROUTER]
    path = os.path.join(logdir, "envoy.yaml")
    with open(path, "w") as f:
        f.write(envoyconf.to_yaml(doc))
    # KVROUTE_BENCH_ENVOY_WRAP: a command Envoy runs under, e.g. "strace -f -ttt -o /tmp/st.txt"
    # (a profiler's view of one run; it slows Envoy, so not for numbers).
    argv = os.environ.get("KVROUTE_BENCH_ENVOY_WRAP", "").split() + [
        paths.ENVOY, "-c", path, "--concurrency", str(cfg["envoy_concurrency"]), "--disable-hot-restart", "-l", "warning"]
    p = Procs.start(argv, os.path.join(logdir, "envoy.log"))
    wait_until(lambda: (http("GET", f"http://127.0.0.1:{admin}/ready")[0] == 200, None), 30, "envoy", [p])
    return p, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


def kvroute_routed(admins):
    """Requests kvroute routed, summed over the Envoy admin URLs (its own stat, so the check
    works with debug headers off)."""
    n = 0
    for a in admins:
        st, _, b = http("GET", a + "/stats?filter=kvroute.requests.routed.total")
        for line in b.decode(errors="replace").splitlines() if st == 200 else []:
            name, _, v = line.partition(":")
            # wasmcustom.kvroute.requests.routed.total in Envoy's own naming
            if name.strip().endswith("kvroute.requests.routed.total") and v.strip().isdigit():
                n += int(v)
    return n


def check_routes(url, procs, policy, admins=()):
    """Waits until the router answers a completion, and for kvroute (`admins`: its Envoys'
    admin URLs) until the filter routed it."""
    def ok():
        before = kvroute_routed(admins) if admins else 0
        st, h, b = http("POST", url + "/v1/completions",
                        {"model": paths.MODEL, "prompt": "ready check", "max_tokens": 1}, timeout=5)
        hl = {k.lower(): v for k, v in h.items()}
        steered = not admins or "x-kvroute-worker" in hl or kvroute_routed(admins) > before
        return st == 200 and steered, (f"HTTP {st} {b[:200]!r} worker={hl.get('x-worker-id')}"
                                       + ("" if steered else " (kvroute.requests.routed did not count it: "
                                          "the filter did not route)"))
    return wait_until(ok, 60, f"{policy} router", procs)


def wait_stream_live(admin, procs, timeout=30.0):
    """Waits until the filter's relay stream is live (kvroute_precise_stream_live >= 1)."""
    def ok():
        st = envoy_kvroute_stats(admin)
        v = stat(st, "kvroute_precise_stream_live")
        return v >= 1, f"kvroute_precise_stream_live {v:g}"
    return wait_until(ok, timeout, "precise mode: the relay stream never went live", procs)


def start_resets(cfg, ws):
    """The `reset_at_s` reset as a timer (None when off): it empties the prefix cache of the
    first half of the answering workers and records when, per worker, in the returned list."""
    at = cfg.get("reset_at_s")
    if at is None:
        return None, []
    targets = decode_workers(ws)[:max(1, len(decode_workers(ws)) // 2)]
    done = []

    def fire():
        for w in targets:
            req = urllib.request.Request(f"http://127.0.0.1:{w['port']}/reset_prefix_cache", data=b"", method="POST")
            try:
                urllib.request.urlopen(req, timeout=5).read()
                done.append({"worker": w["name"], "at_unix": time.time()})
            except OSError as e:
                done.append({"worker": w["name"], "error": str(e)})

    t = threading.Timer(float(at), fire)
    t.start()
    return t, done
