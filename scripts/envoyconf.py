"""Every Envoy bootstrap kvroute runs in, generated from one description.

`bootstrap()` builds the configuration; a `Site` says what differs on purpose between the
places Envoy runs (addresses, how workers are found, timeouts, logging), a list of `Upstream`s
is the fleet. Users of it:

- the committed files below (`make generate` writes them, `make check-generated`, part of
  `make test`, fails when one differs from what this module produces);
- scripts/kvstack.py (end-to-end tests and `make demo`) and bench/run.py, which call
  `bootstrap()` with their own fleets and free ports.

    python3 scripts/envoyconf.py --write    rewrite the generated files
    python3 scripts/envoyconf.py --check    compare them, exit 1 naming the stale ones

Standard library only: it runs before anything is pip-installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION_FILE = os.path.join(ROOT, "envoy", "VERSION")


def envoy_version() -> str:
    """The Envoy release the project builds, tests and ships against (envoy/VERSION)."""
    with open(VERSION_FILE) as f:
        return f.read().strip()


class Note(str):
    """A comment in the YAML output: a dict key (value ignored) or a list item. Not in JSON."""


# ---------------------------------------------------------------- the description

@dataclass
class Upstream:
    """One worker as Envoy and kvroute see it."""

    name: str
    host: str
    port: int
    role: str = "both"
    kv_blocks: int = 4096
    # kvroute's workers[].models; empty: any model.
    models: tuple = ()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def shares_a_model(self, other: "Upstream") -> bool:
        """Whether a request for one of this worker's models may go to `other`."""
        return not self.models or not other.models or bool(set(self.models) & set(other.models))


@dataclass
class Site:
    """Where this Envoy runs. Everything else is the same in every bootstrap."""

    listen: tuple[str, int] = ("127.0.0.1", 10000)
    admin: tuple[str, int] = ("127.0.0.1", 9901)
    wasm: str = "build/kvroute.wasm"
    # Containers: workers are DNS names (STRICT_DNS), actively health-checked; loopback
    # fleets are STATIC and eject a worker that refuses connections (outlier detection).
    dns: bool = False
    outlier_ejection: bool = True
    connect_timeout: str = "0.25s"
    # 0s: no bound, a generation ends when the engine ends it.
    route_timeout: str = "0s"
    stream_idle_timeout: str = "600s"
    # A client must send its whole request within request_timeout (its headers within
    # request_headers_timeout): kvroute holds a stream paused until the body is in, so a client
    # that stalls mid-body would otherwise hold it (and its buffer) for stream_idle_timeout.
    # Envoy disarms request_timeout once the request has gone upstream, so a generation that
    # runs for minutes afterwards is unaffected.
    request_timeout: str = "60s"
    request_headers_timeout: str = "10s"
    # Overload manager: a ceiling on open client connections (Envoy warns at start without
    # one) and on Envoy's heap (size it to the memory Envoy may use: each connection can buffer
    # a 32 MiB prompt). Near the heap ceiling Envoy closes idle HTTP/1 connections, at it it
    # answers new requests 503 instead of growing until the kernel kills it.
    max_downstream_connections: int = 10000
    max_heap_bytes: int = 4 << 30
    access_log: bool = False
    # The access log's line format: empty for ACCESS_LOG_FORMAT.
    access_log_format: str = ""
    # Requests kvroute does not steer: round-robin over the decode workers (a pool cluster)
    # instead of the first decode worker's cluster (which fails over to the others).
    fallback_pool: bool = False
    # Load tests: circuit breakers and upstream buffers out of the way of the offered load.
    load_test: bool = False
    # Engines that do not name themselves (llama-server): Envoy adds `x-worker-id` to each
    # response from the answering endpoint's metadata, so clients and tests know who served it.
    worker_id_header: bool = False
    # A `<worker>-metrics` cluster per worker holding only that worker (no failover), for
    # kvroute's metrics poller (`metrics.cluster_suffix: "-metrics"`).
    metrics_clusters: bool = False
    # Precise mode: kvroute-relay's gRPC address; adds the `kvroute-relay` cluster (HTTP/2)
    # that the plugin's `precise.cluster` names.
    relay: tuple[str, int] | None = None
    header: list[str] = field(default_factory=list)


STATS_TAGS = [
    ("outcome", r"^wasmcustom\.kvroute\.requests\.((.+?)\.)total$"),
    ("reason", r"^wasmcustom\.kvroute\.fallbacks\.((.+?)\.)total$"),
    ("decision", r"^wasmcustom\.kvroute\.disagg_decisions\.((.+?)\.)total$"),
    ("kind", r"^wasmcustom\.kvroute\.(?:feedback|replication)\.((.+?)\.)total$"),
    ("worker", r"^wasmcustom\.kvroute\.worker\.((.+?)\.)\w+$"),
    ("rung", r"^wasmcustom\.kvroute\.reuse_(?:unreported_)?tokens\.((.+?)\.)total$"),
]

ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}

ACCESS_LOG_FORMAT = ("[%START_TIME%] \"%REQ(:METHOD)% %REQ(:PATH)%\" %RESPONSE_CODE% %RESPONSE_FLAGS% "
                     "steer=%REQ(X-KVROUTE-CLUSTER)% upstream=%UPSTREAM_HOST% "
                     "attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% %DURATION%ms\n")


# Where a request's time went inside Envoy (bench/run.py --set envoy_timing_log=true): the
# stream's start in unix seconds, then microseconds from the first request byte to the last
# one, to the first and last byte sent upstream, and to the upstream connection's start and
# end (set for a new connection only); the upstream connection id tells a reused one apart.
TIMING_LOG_FORMAT = ("timing start=%START_TIME(%s.%6f)% "
                     "rx_end=%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)% "
                     "up_tx_beg=%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% "
                     "up_tx_end=%COMMON_DURATION(DS_RX_BEG:US_TX_END:us)% "
                     "up_cx_beg=%COMMON_DURATION(DS_RX_BEG:US_CX_BEG:us)% "
                     "up_cx_end=%COMMON_DURATION(DS_RX_BEG:US_CX_END:us)% "
                     "up_cx=%UPSTREAM_CONNECTION_ID% upstream=%UPSTREAM_HOST% bytes=%BYTES_RECEIVED%\n")


WORKER_ID_FORMAT = "%UPSTREAM_METADATA(kvroute:worker)%"


def retry_policy(explain: bool = True) -> dict:
    why = Note if explain else (lambda _: None)
    return {k: v for k, v in {
        why("Only failures where the worker produced no response: a refused or timed-out\n"
            "connection, a reset before response headers, gRPC UNAVAILABLE (engines behind\n"
            "a gRPC front end). Envoy never retries once response headers went to the\n"
            "client, so a stream is never duplicated; a worker's own 4xx/5xx passes\n"
            "through and kvroute counts it against the worker."): None,
        why("A worker that accepts a request and never answers: kvroute sets\n"
            "x-envoy-upstream-rq-per-try-timeout-ms on each request it steers, a bound on the\n"
            "wait for response headers from its prefill estimate (and, for a non-streaming\n"
            "answer, its max_tokens; docs/configuration.md \"Timeouts\"). Envoy resets a try that outlives\n"
            "it and `reset` retries it on another worker, which kvroute counts against the\n"
            "stalled one (x-envoy-attempt-count > 1). The bound is disarmed once headers went\n"
            "to the client, so it never cuts a stream; no per_try_idle_timeout here, as an idle\n"
            "bound would also cut non-streaming answers, which send nothing until done."): None,
        "retry_on": "connect-failure,refused-stream,reset,unavailable",
        "num_retries": 2,
        why("Each worker's cluster is [priority 0: the worker, priority 1: the rest of its\n"
            "pool]; previous_priorities makes a retry skip the priority that just failed,\n"
            "so it lands on another worker instead of knocking on the dead one again."): None,
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        },
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 3,
    }.items() if k is not None}


def _endpoint(site: Site, w: Upstream) -> dict:
    ep = {"endpoint": {"address": {"socket_address": {"address": w.host, "port_value": w.port}}}}
    if site.dns or site.worker_id_header:
        ep["metadata"] = {"filter_metadata": {"kvroute": {"worker": w.name}}}
    return ep


def _cluster(site: Site, name: str, endpoints: list, lb_policy: str | None = None, eject: bool = False) -> dict:
    c: dict = {"name": name, "type": "STRICT_DNS" if site.dns else "STATIC"}
    if lb_policy and lb_policy != "ROUND_ROBIN":
        c["lb_policy"] = lb_policy
    if site.dns:
        c["dns_lookup_family"] = "V4_ONLY"
        c["dns_refresh_rate"] = "2s"
    c["connect_timeout"] = site.connect_timeout
    if site.dns:
        c["health_checks"] = [{"timeout": "2s", "interval": "1s", "no_traffic_interval": "1s",
                               "unhealthy_threshold": 3, "healthy_threshold": 1,
                               "http_health_check": {"path": "/health"}}]
    elif eject and site.outlier_ejection:
        c["outlier_detection"] = {"consecutive_local_origin_failure": 2,
                                  "split_external_local_origin_errors": True,
                                  "base_ejection_time": "5s", "max_ejection_percent": 100}
    if site.load_test:
        c["per_connection_buffer_limit_bytes"] = 33554432
        c["circuit_breakers"] = {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                                 "max_requests": 100000, "max_retries": 100}]}
    elif eject:
        # Envoy allows 3 concurrent retries per cluster by default: a worker that dies or
        # resets with dozens of requests waiting for their first byte would have all but
        # three of them fail instead of retried elsewhere. Retries stay bounded by the
        # route's num_retries; this only lets each of those requests have its retry.
        c["circuit_breakers"] = {"thresholds": [{"max_retries": 1024}]}
    c["load_assignment"] = {"cluster_name": name, "endpoints": endpoints}
    return c


RELAY_CLUSTER = "kvroute-relay"


def relay_cluster(site: Site) -> dict:
    host, port = site.relay or ("127.0.0.1", 7000)
    c: dict = {"name": RELAY_CLUSTER, "type": "STRICT_DNS" if site.dns else "STATIC",
               "connect_timeout": site.connect_timeout,
               "typed_extension_protocol_options": {
                   "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                       "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                       "explicit_http_config": {"http2_protocol_options": {}}}}}
    if site.dns:
        c["dns_lookup_family"] = "V4_ONLY"
    c["load_assignment"] = {"cluster_name": RELAY_CLUSTER, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}]}
    return c


def worker_clusters(site: Site, fleet: list[Upstream]) -> list:
    """One cluster per worker (what kvroute names in x-kvroute-cluster): the worker at
    priority 0, the other workers of its pool (prefill or decode) at priority 1."""
    out: list = [Note("One cluster per worker: the name is what kvroute writes into x-kvroute-cluster\n"
                      "(a worker's \"cluster\" key, its name by default). Priority 0 is the worker,\n"
                      "priority 1 the rest of its pool, used by retries (see retry_policy).")]
    if site.dns:
        out.append(Note(
            "STRICT_DNS on the compose service name: Docker's DNS answers for a service only\n"
            "while its container runs, so a killed worker drops out at the next re-resolution\n"
            "(2 s) and a restarted one comes back. Active health checks on /health every second,\n"
            "also while idle (these clusters see traffic only when kvroute picks their worker):\n"
            "three failures (2 s timeout each, so a busy machine does not flap a live worker)\n"
            "mark it unhealthy and Envoy sends the cluster's traffic to priority 1 at once.\n"
            "A stopped container stops answering: a short connect_timeout keeps a request\n"
            "from hanging on it before the retry. Each endpoint names its worker in metadata."))
    elif site.outlier_ejection:
        out.append(Note("A worker that refuses connections is ejected for a while, also for first tries."))
    if not site.load_test:
        out.append(Note("max_retries: a worker that dies with many requests still waiting for their first\n"
                        "byte gets each of them retried (Envoy's default allows 3 retries at once per cluster)."))
    for w in fleet:
        pool = [o for o in fleet if (o.role == "prefill") == (w.role == "prefill") and o is not w
                and w.shares_a_model(o)]
        endpoints = [{"priority": 0, "lb_endpoints": [_endpoint(site, w)]}]
        if pool:
            endpoints.append({"priority": 1, "lb_endpoints": [_endpoint(site, o) for o in pool]})
        out.append(_cluster(site, w.name, endpoints, eject=True))
    if site.metrics_clusters:
        out.append(Note("kvroute's metrics poller scrapes each worker through a cluster of that worker alone,\n"
                        "so a failover never attributes one worker's load to another."))
        for w in fleet:
            out.append(_cluster(site, f"{w.name}-metrics", [{"lb_endpoints": [_endpoint(site, w)]}]))
    return out


def plugin_text(cfg: dict) -> str:
    """The plugin configuration as JSON, one worker per line."""
    lines = ["{"]
    items = list(cfg.items())
    for i, (k, v) in enumerate(items):
        comma = "," if i + 1 < len(items) else ""
        if k == "workers" and isinstance(v, list) and v:
            lines.append('  "workers": [')
            lines += [f"    {json.dumps(w)}" + ("," if j + 1 < len(v) else "") for j, w in enumerate(v)]
            lines.append("  ]" + comma)
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)}{comma}")
    return "\n".join(lines + ["}"]) + "\n"


def plugin_workers(fleet: list[Upstream]) -> list[dict]:
    return [{"name": w.name, "cluster": w.name, "endpoint": w.endpoint, "role": w.role, "kv_blocks": w.kv_blocks,
             **({"models": list(w.models)} if w.models else {})}
            for w in fleet]


# The environment variable holding kvroute-relay's token (the filter's relay.token_env).
RELAY_TOKEN_ENV = "KVROUTE_RELAY_TOKEN"


def wasm_filter(site: Site, plugin: dict) -> dict:
    vm_config: dict = {
        Note("One vm_id for all threads: the filter's VMs find each other's shared\n"
             "queues under it to replicate routing decisions."): None,
        "vm_id": "kvroute",
        "runtime": "envoy.wasm.runtime.v8",
        "code": {"local": {"filename": site.wasm}},
    }
    if site.relay:
        vm_config[Note("The relay's token, from Envoy's own environment (never in this file): the filter\n"
                       "sends it as `authorization: Bearer <token>` (relay.token_env).")] = None
        vm_config["environment_variables"] = {"host_env_keys": [RELAY_TOKEN_ENV]}
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "kvroute",
                "root_id": "kvroute",
                "vm_config": vm_config,
                Note("kvroute pauses in the request-headers callback until it has the body; without\n"
                     "this (Envoy >= 1.35) the pause would also stop the body callbacks."): None,
                "allow_on_headers_stop_iteration": True,
                Note("A crashed VM is recreated instead of failing every request on its thread."): None,
                "failure_policy": "FAIL_RELOAD",
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    Note("The plugin configuration; docs/configuration.md has every key."): None,
                    "value": plugin_text(plugin),
                },
            },
        },
    }


def overload_manager(site: Site) -> dict:
    heap = "envoy.resource_monitors.fixed_heap"

    def on_heap(action: str, share: float) -> dict:
        return {"name": f"envoy.overload_actions.{action}", "triggers": [{"name": heap, "threshold": {"value": share}}]}

    return {
        Note("Past max_active_downstream_connections Envoy refuses new client connections.\n"
             "Heap: at 95 % of max_heap_size_bytes Envoy stops HTTP/1 keep-alive (clients\n"
             "reconnect, idle connections go), at 98 % it answers new requests 503 until memory\n"
             "is back below. Size max_heap_size_bytes to the memory Envoy may use."): None,
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {"name": heap, "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": site.max_heap_bytes}},
            {"name": "envoy.resource_monitors.global_downstream_max_connections", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": site.max_downstream_connections}},
        ],
        "actions": [on_heap("disable_http_keepalive", 0.95), on_heap("stop_accepting_requests", 0.98)],
    }


def bootstrap(site: Site, fleet: list[Upstream], plugin: dict | None = None,
              lb_policy: str = "ROUND_ROBIN") -> dict:
    """An Envoy bootstrap. With `plugin` (kvroute's configuration) the wasm filter picks the
    worker and the route follows its header; without it every decode worker sits in one
    cluster balanced by `lb_policy` (the baselines kvroute is measured against)."""
    decode = [w for w in fleet if w.role != "prefill"]
    endpoint_mode = plugin is not None and (plugin.get("steering") or {}).get("mode") == "endpoint"

    def route(target: dict, explain: bool = False) -> dict:
        return {**target, "timeout": site.route_timeout, "retry_policy": retry_policy(explain)}

    if plugin is None:
        clusters = [_cluster(site, "pool", [{"lb_endpoints": [_endpoint(site, w) for w in decode]}], lb_policy)]
        routes = [{"match": {"prefix": "/"},
                   "route": {**route({"cluster": "pool"}, explain=True),
                             Note("Used by RING_HASH and MAGLEV only: a session sticks to a worker."): None,
                             "hash_policy": [{"header": {"header_name": "x-session-id"}}]}}]
    elif endpoint_mode:
        # Gateway API Inference Extension style: the filter names ip:port and an ORIGINAL_DST
        # cluster connects there (one endpoint only, so the plugin sets fallbacks to 0).
        header = plugin["steering"].get("header", "x-gateway-destination-endpoint")
        clusters = [{"name": "picked", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                     "connect_timeout": site.connect_timeout,
                     "original_dst_lb_config": {"use_http_header": True, "http_header_name": header}}]
        routes = [{"match": {"prefix": "/"}, "route": {"cluster": "picked", "timeout": site.route_timeout}}]
    else:
        clusters = worker_clusters(site, fleet)
        fallback = decode[0].name
        if site.fallback_pool:
            fallback = "decode-pool"
            clusters.append(Note("Requests kvroute leaves alone, round-robin over the decode workers."))
            clusters.append(_cluster(site, fallback, [{"lb_endpoints": [_endpoint(site, w) for w in decode]}]))
        routes = [
            Note("kvroute decided: go to the cluster it named. Setting the header clears Envoy's\n"
                 "route cache, so this match is evaluated after the filter ran."),
            {"match": {"prefix": "/", "headers": [{"name": "x-kvroute-cluster", "present_match": True}]},
             "route": route({"cluster_header": "x-kvroute-cluster"}, explain=True)},
            Note("Everything kvroute does not steer (GET /v1/models, /health, or kvroute not loaded)."),
            {"match": {"prefix": "/"}, "route": route({"cluster": fallback})},
        ]
    if plugin is not None and site.relay:
        clusters.append(Note("kvroute-relay (precise mode): the engines' own KV cache events, re-keyed to\n"
                             "kvroute's block hashes, as one gRPC stream per Envoy process (HTTP/2)."))
        clusters.append(relay_cluster(site))
    filters = ([] if plugin is None else [wasm_filter(site, plugin)]) + [ROUTER]
    hcm: dict = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        Note("This is the edge: the client is the peer of the TCP connection, not whatever its\n"
             "x-forwarded-for says, and no client address counts as internal (no\n"
             "internal_address_config: Envoy 1.40 then trusts none; an empty one would make\n"
             "loopback and RFC 1918 clients internal). Envoy therefore drops the x-envoy-* request\n"
             "headers a client sends (x-envoy-upstream-rq-timeout-ms, x-envoy-retry-on,\n"
             "x-envoy-max-retries, ...) instead of letting it change timeouts and retries.\n"
             "Behind a trusted load balancer that appends to x-forwarded-for, raise\n"
             "xff_num_trusted_hops to the number of such hops."): None,
        "use_remote_address": True,
        "xff_num_trusted_hops": 0,
        Note("Generation streams for minutes: no idle cut-off shorter than that. A worker that\n"
             "stalls after its response headers went out is cut here (one that stalls before is\n"
             "cut per try, see retry_policy); Envoy cannot retry it then anyway."): None,
        "stream_idle_timeout": site.stream_idle_timeout,
        Note("But the request itself must arrive in time: kvroute holds a stream paused until the\n"
             "body is in, so a client that stalls mid-body gets 408 here instead of holding it for\n"
             "the idle timeout. Envoy disarms request_timeout once the request went upstream,\n"
             "so it does not bound the generation."): None,
        "request_timeout": site.request_timeout,
        "request_headers_timeout": site.request_headers_timeout,
    }
    if site.access_log:
        hcm["access_log"] = [{
            "name": "envoy.access_loggers.stdout",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                "log_format": {"text_format_source": {"inline_string": site.access_log_format or ACCESS_LOG_FORMAT}}},
        }]
    hcm["route_config"] = {"name": "llm", "virtual_hosts": [{
        "name": "llm",
        "domains": ["*"],
        Note("x-envoy-attempt-count on responses tells kvroute (and tests) that its pick failed\n"
             "and a retry on another worker answered."): None,
        "include_attempt_count_in_response": True,
        **({Note("The engines do not name themselves: x-worker-id comes from the endpoint's metadata."): None,
            "response_headers_to_add": [{
                "header": {"key": "x-worker-id", "value": WORKER_ID_FORMAT},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]} if site.worker_id_header else {}),
        "routes": routes,
    }]}
    hcm["http_filters"] = filters
    doc: dict = {}
    if site.header:
        doc[Note("\n".join(site.header))] = None
    doc["admin"] = {"address": {"socket_address": {"address": site.admin[0], "port_value": site.admin[1]}}}
    doc[Note("kvroute's stats carry label values inside their names (kvroute.worker.<name>.inflight;\n"
             "Envoy stores wasm metrics under \"wasmcustom.\"). These regexes turn them into Prometheus\n"
             "labels, kvroute_worker_decisions_total{worker=\"decode-1\"}: the first capture group is\n"
             "cut out of the name, the inner one is the label value.")] = None
    doc["stats_config"] = {"stats_tags": [{"tag_name": t, "regex": r} for t, r in STATS_TAGS]}
    doc["overload_manager"] = overload_manager(site)
    doc["static_resources"] = {
        "listeners": [{
            "name": "inference",
            "address": {"socket_address": {"address": site.listen[0], "port_value": site.listen[1]}},
            Note("kvroute buffers whole request bodies; Envoy's 1 MiB default would answer long\n"
                 "prompts with 413. 32 MiB is about 8M tokens of text."): None,
            "per_connection_buffer_limit_bytes": 33554432,
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}],
        }],
        "clusters": clusters,
    }
    return doc


# ---------------------------------------------------------------- output

def plain(x):
    """The document without its notes: what goes to Envoy as JSON."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items() if not isinstance(k, Note)}
    if isinstance(x, list):
        return [plain(v) for v in x if not isinstance(v, Note)]
    return x


WIDTH = 100
_SAFE = re.compile(r"^[A-Za-z0-9_/][A-Za-z0-9_./-]*$")
_AMBIGUOUS = re.compile(r"^(true|false|yes|no|on|off|y|n|null|~|[-+]?[0-9_]*\.?[0-9_]*([eE][-+]?[0-9]+)?"
                        r"|0x[0-9a-fA-F]+|0o[0-7]+|\.inf|\.nan)$", re.I)


def _scalar(v) -> str:
    if v is True or v is False:
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    s = str(v)
    if any(ord(c) < 32 for c in s):
        return json.dumps(s)
    if _SAFE.match(s) and not _AMBIGUOUS.match(s):
        return s
    return "'" + s.replace("'", "''") + "'"


def _multiline(v) -> bool:
    return isinstance(v, str) and "\n" in v.rstrip("\n")


def _flow(v) -> str | None:
    """One-line form, or None when the node holds notes or a multi-line string."""
    if isinstance(v, dict):
        parts = []
        for k, x in v.items():
            f = _flow(x)
            if isinstance(k, Note) or f is None:
                return None
            parts.append(f"{_scalar(k)}: {f}")
        return "{" + ", ".join(parts) + "}"
    if isinstance(v, list):
        parts = [_flow(x) for x in v]
        if any(isinstance(x, Note) for x in v) or None in parts:
            return None
        return "[" + ", ".join(parts) + "]"
    return None if _multiline(v) else _scalar(v)


def _comment(note: str, pad: str) -> list[str]:
    return [f"{pad}# {line}".rstrip() for line in note.split("\n")]


def _block(v, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(v, dict):
        for k, x in v.items():
            if isinstance(k, Note):
                out += _comment(k, pad)
                continue
            head = f"{pad}{_scalar(k)}:"
            if _multiline(x):
                out.append(head + " |")
                out += [(pad + "  " + line).rstrip() for line in x.rstrip("\n").split("\n")]
                continue
            f = _flow(x)
            if f is not None and (not isinstance(x, (dict, list)) or len(head) + 1 + len(f) <= WIDTH):
                out.append(f"{head} {f}")
                continue
            out.append(head)
            _block(x, indent + 2 if isinstance(x, dict) else indent, out)
        return
    for x in v:
        if isinstance(x, Note):
            out += _comment(x, pad)
            continue
        f = _flow(x)
        if f is not None and len(pad) + 2 + len(f) <= WIDTH:
            out.append(f"{pad}- {f}")
            continue
        sub: list[str] = []
        _block(x, indent + 2, sub)
        first = next(i for i, line in enumerate(sub) if not line.lstrip().startswith("#"))
        out += [pad + line.lstrip() for line in sub[:first]]
        out.append(f"{pad}- {sub[first][indent + 2:]}")
        out += sub[first + 1:]


def to_yaml(doc: dict) -> str:
    out: list[str] = []
    _block(doc, 0, out)
    # A blank line before each top-level key that follows a nested block, for the reader.
    spaced: list[str] = []
    for i, line in enumerate(out):
        if i and line[:1] not in (" ", "") and out[i - 1][:1] == " ":
            spaced.append("")
        spaced.append(line)
    return "\n".join(spaced) + "\n"


# ---------------------------------------------------------------- the generated files

GENERATED = "Generated by scripts/envoyconf.py (`make generate`); edit that file, not this one."

# The demo fleet of `make run` and the compose quickstart: four decode workers, a prefill pool.
DEMO_WORKERS = [("decode-1", "decode"), ("decode-2", "decode"), ("decode-3", "decode"), ("decode-4", "decode"),
                ("prefill-1", "prefill"), ("prefill-2", "prefill")]
DEMO_OPTIONS = {"block_size": 16, "disaggregation": {"threshold_tokens": 5000},
                # Off where anyone can connect: x-kvroute-predicted-cached-tokens and friends
                # would tell any client whether someone recently sent a given prefix. Workers
                # name themselves in x-worker-id (and x-prefill-worker-id after a hand-off).
                "debug_headers": False}


def demo_fleet() -> list[Upstream]:
    """envoy/demo.yaml's workers: decode on 127.0.0.1:8001-8004, prefill on 8101-8102."""
    ports = {"decode": 8001, "prefill": 8101}
    out = []
    for name, role in DEMO_WORKERS:
        out.append(Upstream(name, "127.0.0.1", ports[role], role, kv_blocks=4096))
        ports[role] += 1
    return out


# The name under which each compose gateway finds its own relay (a per-gateway network alias).
COMPOSE_RELAY = "kvroute-relay"


def compose_fleet() -> list[Upstream]:
    return [Upstream(name, name, 8000, role, kv_blocks=16384) for name, role in DEMO_WORKERS]


def bench_site(port: int, admin: int, wasm: str) -> Site:
    """bench/run.py's Envoy: loopback workers that never fail on purpose, so no ejection (an
    ejected worker would silently reroute its requests), and limits sized for load tests."""
    return Site(listen=("127.0.0.1", port), admin=("127.0.0.1", admin), wasm=wasm, outlier_ejection=False,
                connect_timeout="2s", load_test=True)


def bench_plugin(fleet: list[Upstream], block_size: int, extra: dict | None = None) -> dict:
    """bench/run.py's kvroute configuration: without a prefill pool every worker decodes and
    disaggregation is off; with one, the pool's workers say so and disaggregation keeps its
    defaults."""
    pool = any(w.role == "prefill" for w in fleet)
    workers = plugin_workers(fleet) if pool else [
        {"name": w.name, "cluster": w.name, "endpoint": w.endpoint, "kv_blocks": w.kv_blocks} for w in fleet]
    c = {"workers": workers,
         "block_size": block_size, "debug_headers": False,
         "disaggregation": {} if pool else {"threshold_tokens": 0}}
    for k, v in (extra or {}).items():
        if isinstance(v, dict):
            c.setdefault(k, {}).update(v)
        else:
            c[k] = v
    return c


def _bench_sample() -> tuple[list[Upstream], Site]:
    fleet = [Upstream(f"w{i}", "127.0.0.1", 18000 + i, kv_blocks=65536) for i in range(8)]
    return fleet, bench_site(10000, 9901, "build/kvroute.wasm")


def shipped() -> dict[str, tuple[Site, list[Upstream], dict | None]]:
    """What each generated bootstrap is made of: path -> (site, fleet, kvroute configuration)."""
    head = [GENERATED, ""]
    demo = Site(header=head + [
        "kvroute demo stack (`make run`): Envoy on 127.0.0.1:10000 (admin 127.0.0.1:9901) in front of",
        "four decode workers (127.0.0.1:8001-8004) and a prefill pool of two (127.0.0.1:8101-8102).",
        "Run from the repository root: the wasm path is relative to it.",
        "",
        "How a request flows: the kvroute wasm filter holds POST /v1/completions and",
        "/v1/chat/completions until the body is in, hashes the prompt, picks a worker and sets",
        "`x-kvroute-cluster: <cluster>`; the first route follows that header to the worker's",
        "cluster. Long uncached prompts go to a prefill cluster; the filter names the decode worker",
        "in `x-kvroute-decode-endpoint` and the prefill worker hands the KV over to it."])
    compose = Site(listen=("0.0.0.0", 10000), admin=("0.0.0.0", 9901), wasm="/etc/envoy/kvroute.wasm",
                   dns=True, outlier_ejection=False, connect_timeout="0.5s", route_timeout="600s",
                   stream_idle_timeout="300s", access_log=True, fallback_pool=True,
                   relay=(COMPOSE_RELAY, 7000), header=head + [
                       "Envoy bootstrap for the docker-compose quickstart: kvroute in front of 4 decode and",
                       "2 prefill mock workers, reached by their compose service names. Both gateways",
                       "(envoy-1, envoy-2) run this file: each reaches its own kvroute-relay (relay-1,",
                       "relay-2) under the name `kvroute-relay`, an alias that exists only on the private",
                       "network it shares with that relay (docker-compose.yaml). Precise mode: the workers",
                       "publish vLLM-format KV cache events, the relay serves them re-keyed over gRPC, and",
                       "a decode worker's POST /tokenize (beside each request) maps text prompts to them.",
                       "The relays share the two gateways' decisions over NATS.",
                       "",
                       "Differences from envoy/demo.yaml (loopback ports), all from scripts/envoyconf.py's Site:",
                       "workers are DNS names resolved by Docker's embedded DNS (STRICT_DNS) and actively",
                       "health-checked (the worker image is FROM scratch, so Docker cannot probe inside it),",
                       "admin and listener bind 0.0.0.0 (docker-compose.yaml publishes them on 127.0.0.1",
                       "only: never publish the admin port beyond the host, it can stop Envoy), requests are",
                       "logged to stdout, routes end after 600 s, and unsteered requests go round-robin."])
    bench_fleet, bench = _bench_sample()
    bench_head = head + ["What bench/run.py starts for the {}, shown with example",
                         "ports: run.py calls scripts/envoyconf.py's bootstrap() with free ports and the",
                         "preset's values."]
    bench.header = [line.format("kvroute policies") for line in bench_head]
    baseline = _bench_sample()[1]
    baseline.header = [line.format("Envoy lb_policy baselines (here ROUND_ROBIN)") for line in bench_head]
    demo_plugin = {"workers": plugin_workers(demo_fleet()), **DEMO_OPTIONS}
    precise = Site(relay=("127.0.0.1", 7000), header=head + [
        "kvroute demo stack in precise mode (`make run PRECISE=1`): envoy/demo.yaml plus the",
        "`kvroute-relay` cluster. The mock workers publish vLLM-format KV cache events on",
        "tcp://127.0.0.1:5557-5560 (decode) and :5561-5562 (prefill), replay on :5657-5662;",
        "kvroute-relay subscribes to them and serves them on 127.0.0.1:7000 (metrics :7001); the",
        "filter holds one gRPC stream to it per Envoy process and routes on what the engines",
        "report holding. Without the relay it routes on its own predictions, as envoy/demo.yaml.",
        "The relay demands a token: start Envoy with it in KVROUTE_RELAY_TOKEN (`make run` does)."])
    # Text prompts are mapped to the engines' blocks through POST /tokenize, called beside each
    # request (never on its path): the first decode worker's cluster (which fails over to the
    # pool) answers it.
    precise_plugin = {**demo_plugin, "relay": {"cluster": RELAY_CLUSTER},
                      "tokenize": {"cluster": demo_plugin["workers"][0]["cluster"]}}
    # The compose gateways: precise mode and decision sharing through their relays; any decode
    # worker tokenizes as all of them do, so the round-robin decode pool answers /tokenize.
    compose_plugin = {"workers": plugin_workers(compose_fleet()), **DEMO_OPTIONS,
                      "relay": {"cluster": RELAY_CLUSTER},
                      "tokenize": {"cluster": "decode-pool"}}
    return {
        "envoy/demo.yaml": (demo, demo_fleet(), demo_plugin),
        "envoy/demo-precise.yaml": (precise, demo_fleet(), precise_plugin),
        "examples/docker-compose/envoy.yaml": (compose, compose_fleet(), compose_plugin),
        "bench/envoy/kvroute.yaml": (bench, bench_fleet, bench_plugin(bench_fleet, 16)),
        "bench/envoy/baseline.yaml": (baseline, bench_fleet, None),
    }


def files() -> dict[str, str]:
    """Every committed file this module owns: path relative to the repository -> content."""
    return {path: to_yaml(bootstrap(*parts)) for path, parts in shipped().items()}


# Files that carry the Envoy version as a default for users who run them without make.
VERSIONED = {
    "examples/docker-compose/docker-compose.yaml": re.compile(r"(envoyproxy/envoy:v)[0-9][0-9.]*"),
}


def rendered() -> dict[str, str]:
    out = files()
    for path, pattern in VERSIONED.items():
        with open(os.path.join(ROOT, path)) as f:
            out[path] = pattern.sub(lambda m: m.group(1) + envoy_version(), f.read())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="rewrite the generated files")
    g.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    g.add_argument("--print", metavar="PATH", help="print one generated file")
    a = ap.parse_args()
    out = rendered()
    if a.print:
        sys.stdout.write(out[a.print])
        return 0
    stale = []
    for path, text in out.items():
        full = os.path.join(ROOT, path)
        old = open(full).read() if os.path.exists(full) else None
        if old == text:
            continue
        if a.write:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(text)
            print(f"envoyconf: wrote {path}")
        else:
            stale.append(path)
    if stale:
        print("envoyconf: these files differ from what scripts/envoyconf.py generates:\n  "
              + "\n  ".join(stale)
              + "\nRegenerate them with `make generate` (python3 scripts/envoyconf.py --write) and commit"
                " the result; edit scripts/envoyconf.py, not the generated files.", file=sys.stderr)
        return 1
    if a.check:
        print(f"envoyconf: {len(out)} generated files up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
