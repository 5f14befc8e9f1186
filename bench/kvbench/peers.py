"""The peer routers, each a black box in front of the same mock workers as kvroute, and the
ext_proc floor (issue 43).

- `sglang-cache-aware`, `vllm-router-cache-aware`: `sglang-router launch --policy cache_aware`
  and `vllm-router --policy cache_aware` (PyPI, build/sglang-venv and build/vllmr-venv).
- `vllm-router-kv-aware`: vllm-router's `kv_aware` policy fed by the workers' KV events
  (`--kv-event-source URL=tcp://...`).
- `dynamo-kv`, `dynamo-approx` (and `-tuned`): Dynamo's KV router, i.e. the selection service of
  the `ai-dynamo-runtime` wheel (`python -m dynamo.select_service`, build/dynamo-venv). `-kv`
  subscribes to the workers' vLLM-format ZMQ KV events; `-approx` is its approximate mode
  (DYN_ROUTER_USE_KV_EVENTS=false: it predicts the caches from its own routing). Plain names run
  Dynamo's defaults; `-tuned` sets DYN_ROUTER_PREFILL_LOAD_SCALE to TUNED_SCALE (Dynamo's own
  sweep recommends 16-32; the value here was picked by a dev-split sweep, bench/README.md). Our
  glue (dynamo-glue, Rust, beside the mock worker) carries the requests (tokenize,
  select_and_reserve, forward, prefill_complete, free) and decides nothing.
- The ext_proc floor (`make overhead`): Envoy with an ext_proc filter calling the least endpoint
  picker there can be (relay/examples/extproc_picker.rs), for the proxy-overhead table.

Which of them a policy starts, and whether its fleet publishes KV events, is its row in
policies.POLICY.
"""

import json
import os

import envoyconf

from kvbench import paths
from kvbench.policies import POLICY
from kvbench.procs import Procs, free_port, http, wait_until
from kvbench.stack import decode_workers

DYNAMO_PY = os.path.join(paths.BUILD, "dynamo-venv", "bin", "python")
# Our glue in front of it (examples/mock-worker/src/bin/dynamo-glue.rs, built with the mock).
GLUE = os.path.join(paths.ROOT, "target", "release", "dynamo-glue")
PICKER = os.environ.get("KVROUTE_EXTPROC_PICKER") or os.path.join(paths.ROOT, "target", "relay", "examples",
                                                                  "extproc_picker")

# DYN_ROUTER_PREFILL_LOAD_SCALE of the -tuned policies (Dynamo's default is 1).
TUNED_SCALE = 32.0
KV_AWARE = "vllm-router-kv-aware"


def start(cfg, policy, ws, logdir):
    """Starts the peer router of `policy` in front of the decode workers of ws (started with
    kv_events where its POLICY row has events); returns (processes, URL, CPU parts), the parts
    naming which processes are the router proper and which our glue (none for the PyPI
    routers' cache_aware). cfg's `dynamo_tuned_scale` (--set dynamo_tuned_scale=32) overrides
    TUNED_SCALE (the sweep)."""
    workers = decode_workers(ws)
    pol = POLICY[policy]
    if pol.router in ("sglang", "vllm-router"):
        exe, sub, level = (paths.SGLANG, ["launch"], "warn") if pol.router == "sglang" else (paths.VLLMR, [], "warning")
        more = []
        if pol.events:
            # vllm-router's kv_aware: each worker's KV event publisher (and replay socket) as
            # its sources, its defaults otherwise.
            more = ["--kv-event-block-size", str(cfg["block_size"]), "--kv-event-model", paths.MODEL]
            for w in workers:
                more += ["--kv-event-source", f"{w['url']}=tcp://127.0.0.1:{w['kv_events']}",
                         "--kv-event-replay-source", f"{w['url']}=tcp://127.0.0.1:{w['kv_replay']}"]
        p, url = start_router(exe, sub, workers, "kv_aware" if pol.events else "cache_aware", level, logdir, more)
        return [p], url, {"router": [p]} if pol.events else {}
    if pol.router != "dynamo":
        raise ValueError(f"not a peer router: {policy}")
    events = pol.events
    scale = TUNED_SCALE if pol.tuned else None
    if scale is not None and cfg.get("dynamo_tuned_scale") is not None:
        scale = float(cfg["dynamo_tuned_scale"])
    if not os.path.exists(DYNAMO_PY):
        raise RuntimeError(f"{DYNAMO_PY} missing (make bench-deps: ai-dynamo-runtime install failed?)")
    sport = free_port()
    env = {"DYN_LOG": "warn", "DYN_ROUTER_USE_KV_EVENTS": "true" if events else "false"}
    if scale is not None:
        env["DYN_ROUTER_PREFILL_LOAD_SCALE"] = f"{scale:g}"
    sel = Procs.start([DYNAMO_PY, "-m", "dynamo.select_service", "--port", str(sport)],
                      os.path.join(logdir, "select.log"), env=env)
    surl = f"http://127.0.0.1:{sport}"
    wait_until(lambda: (http("GET", surl + "/health")[0] == 200, None), 60, "dynamo select_service", [sel])
    for i, w in enumerate(workers):
        # The worker as Dynamo's catalog records it: its URL, block size and capacity, and (events)
        # its KV event publisher and replay socket.
        doc = {"worker_id": i, "endpoint": w["url"], "block_size": cfg["block_size"]}
        if cfg.get("kv_blocks"):
            doc["total_kv_blocks"] = cfg["kv_blocks"]
        if events:
            doc["kv_events_endpoint"] = f"tcp://127.0.0.1:{w['kv_events']}"
            doc["replay_endpoint"] = f"tcp://127.0.0.1:{w['kv_replay']}"
        st, _, b = http("POST", surl + "/workers", doc)
        if st not in (200, 201):
            raise RuntimeError(f"dynamo select_service: POST /workers {w['name']}: HTTP {st} {b[:300]!r}")
    wait_until(lambda: (http("GET", surl + "/ready")[0] == 200, None), 30, "dynamo select_service /ready", [sel])
    gport = free_port()
    if not os.path.exists(GLUE):
        raise RuntimeError(f"{GLUE} not built (cargo build --release -p mock-worker)")
    glue = Procs.start([GLUE, "--port", str(gport), "--select", surl,
                        "--workers", ",".join(w["url"] for w in workers)], os.path.join(logdir, "glue.log"))
    with open(os.path.join(logdir, "dynamo.json"), "w") as f:
        json.dump(dict(env=env, select_url=surl), f)
    return [sel, glue], f"http://127.0.0.1:{gport}", {"router": [sel], "glue": [glue]}


def start_router(exe, sub, workers, policy, log_level, logdir, more=()):
    """sglang-router (sub: launch) or vllm-router with `policy` over the workers, their request
    limits and queues out of the way of the load; returns the process and its URL."""
    port = free_port()
    argv = [exe, *sub, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[w["url"] for w in workers],
            "--policy", policy, "--log-level", log_level,
            "--max-concurrent-requests", "100000", "--queue-size", "100000",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *more]
    if not os.path.exists(exe):
        raise RuntimeError(f"{exe} not installed (pip install failed?)")
    return Procs.start(argv, os.path.join(logdir, "router.log")), f"http://127.0.0.1:{port}"


def glue_stats(url):
    """The glue's own numbers so far (its /_glue/stats): requests routed, and the wall ms from a
    request's body read to the worker named (tokenize + selection) and of the tokenize call,
    p50/p90/p99."""
    st, _, b = http("GET", url + "/_glue/stats")
    return json.loads(b) if st == 200 else None


# ---------------------------------------------------------------- the ext_proc floor

EXTPROC_CLUSTER = "extproc-picker"
DEST_HEADER = "x-gateway-destination-endpoint"


def extproc_bootstrap(site, ups, picker_port):
    """An Envoy bootstrap with the ext_proc filter in front of the router: each request's headers,
    then its whole body (BUFFERED) go to the picker over gRPC, and the request goes where its
    x-gateway-destination-endpoint names (an ORIGINAL_DST cluster), as with the Gateway API
    Inference Extension's endpoint pickers."""
    doc = envoyconf.bootstrap(site, ups, None, "ROUND_ROBIN")
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [
        {"match": {"prefix": "/"}, "route": {"cluster": "picked", "timeout": site.route_timeout}}]
    hcm["http_filters"] = [{
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}, "timeout": "10s"},
            "message_timeout": "5s",
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                                "response_header_mode": "SKIP", "response_body_mode": "NONE",
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}},
        envoyconf.ROUTER]
    doc["static_resources"]["clusters"] = [
        {"name": "picked", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": site.connect_timeout,
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST_HEADER}},
        {"name": EXTPROC_CLUSTER, "type": "STATIC", "connect_timeout": site.connect_timeout,
         "typed_extension_protocol_options": {
             "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                 "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                 "explicit_http_config": {"http2_protocol_options": {}}}},
         "load_assignment": {"cluster_name": EXTPROC_CLUSTER, "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": picker_port}}}}]}]}}]
    return doc


def start_extproc(cfg, ws, logdir):
    """The picker and its Envoy in front of the workers ws; returns (envoy, picker, URL)."""
    if not os.path.exists(PICKER):
        raise RuntimeError(f"{PICKER} not built (cargo build --profile relay -p kvroute-relay --example "
                           "extproc_picker)")
    os.makedirs(logdir, exist_ok=True)
    pport = free_port()
    picker = Procs.start([PICKER, "--listen", f"127.0.0.1:{pport}",
                          "--endpoints", ",".join(f"127.0.0.1:{w['port']}" for w in ws)],
                         os.path.join(logdir, "picker.log"))
    port, admin = free_port(), free_port()
    site = envoyconf.bench_site(port, admin, "")
    ups = [envoyconf.Upstream(w["name"], "127.0.0.1", w["port"]) for w in ws]
    path = os.path.join(logdir, "envoy.yaml")
    with open(path, "w") as f:
        f.write(envoyconf.to_yaml(extproc_bootstrap(site, ups, pport)))
    envoy = Procs.start([paths.ENVOY, "-c", path, "--concurrency", str(cfg["envoy_concurrency"]),
                         "--disable-hot-restart", "-l", "warning"], os.path.join(logdir, "envoy.log"))
    wait_until(lambda: (http("GET", f"http://127.0.0.1:{admin}/ready")[0] == 200, None), 30,
               "ext_proc envoy", [envoy, picker])
    return envoy, picker, f"http://127.0.0.1:{port}"
