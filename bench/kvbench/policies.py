"""Every policy the suite can run, in one table (POLICY): which router its cells start and what
that router needs from the cell (KV events from the fleet, a relay, decision sharing between
gateways), and whether it runs by default or behind N gateways. A cell's label is the policy's
name, or `POLICY@N` for N gateways (--replicas). Pure: the report reads it too."""

import dataclasses

import envoyconf


@dataclasses.dataclass(frozen=True)
class Policy:
    # kvroute: Envoy with the filter; envoy: Envoy with a built-in lb_policy; steer: Envoy in
    # kvroute's layout with a Lua filter (a diagnostic of the proxy path, not a router);
    # sglang, vllm-router, dynamo: the peer routers (kvbench/peers.py); oracle: inside loadgen.
    router: str
    lb: str | None = None  # envoy: its lb_policy
    plugin: dict | None = None  # kvroute: settings added to the plugin config
    # kvroute: cfg["tuned"] as plugin settings and the KVROUTE_TUNED_WASM build; dynamo:
    # DYN_ROUTER_PREFILL_LOAD_SCALE (peers.TUNED_SCALE or --set dynamo_tuned_scale).
    tuned: bool = False
    buffered: bool = False  # steer: hold each request until its body is in, as kvroute does
    events: bool = False  # the workers publish KV events (kvroute: its relay subscribes to them)
    shares: bool = False  # at N gateways, their relays share routing decisions over NATS
    replicas: bool = False  # runs at N > 1 gateways
    default: bool = False  # runs when --policies is not given


# kvroute variants of issue 14 (predicted mode is plain kvroute). tokenize: text and chat prompts
# are hashed on the engine's own token ids (POST /tokenize through the round-robin pool of the
# workers, "decode-pool"); precise: the filter also streams the engines' KV cache events from
# kvroute-relay (started with the fleet, per cell).
TOKENIZE_CONFIG = {"tokenize": {"cluster": "decode-pool"}}
PRECISE_CONFIG = dict(TOKENIZE_CONFIG, precise={"cluster": envoyconf.RELAY_CLUSTER})

# Default policies: kvroute, the baselines, the peers (issue 43's too: Dynamo's KV router in both
# modes, at its defaults and at the swept prefill_load_scale, and vllm-router's kv_aware) and the
# oracle. kvroute-tuned, -tokenize and -precise are variants of kvroute for issue 14's comparison:
# they would add runs to make bench's 40-minute budget, and kvroute-precise needs
# target/release/kvroute-relay, which make bench-deps does not build.
#
# Gateway replicas (issue 15, --replicas 1,2,4). A cell `POLICY@N` (N > 1) runs N gateways of
# POLICY in front of one fleet, and one plain Envoy in front of them (no kvroute, a ROUND_ROBIN
# cluster of the N gateway listeners: a cloud load balancer spreading requests one by one), so
# loadgen still targets one URL. One gateway (N = 1) is the policy's usual cell, label POLICY.
# - kvroute, kvroute-tuned, kvroute-tokenize: each gateway has its own kvroute-relay, no
#   --engine, --nats to one nats-server; plugin `relay: {share_decisions: true}`.
# - kvroute-noshare: the same gateways with no relay at all (each routes on what it alone saw).
# - kvroute-precise: relays with every worker's KV events (--engine) and --nats, tokenize on,
#   share_decisions true. kvroute-precise-noshare: the same relays without --nats,
#   share_decisions false (the engines' events still show each gateway every worker's cache).
# - sglang-cache-aware, vllm-router-cache-aware: N independent router processes.
# At one gateway kvroute-noshare is kvroute and kvroute-precise-noshare kvroute-precise (not
# run twice); Envoy's own policies and the oracle hold no routing state and run at N = 1 only.
#
# envoy-steer-rr(-buffered): kvroute's Envoy layout (a cluster per worker, the route following
# x-kvroute-cluster) steered round-robin by a Lua filter instead of the wasm filter; -buffered
# also holds each request until its whole body is in. Against envoy-round-robin and kvroute in
# one run they split the extra per-request time into the layout, the body buffering and the
# wasm filter's own part.
#
# The order is --help's, and the default policies run in it.
POLICY = {
    "kvroute": Policy("kvroute", shares=True, replicas=True, default=True),
    # kvroute with disaggregation: a prefill pool out of the same workers (config.cell_cfg).
    "kvroute-pool": Policy("kvroute"),
    "kvroute-noshare": Policy("kvroute", replicas=True),
    "kvroute-tuned": Policy("kvroute", tuned=True, shares=True, replicas=True),
    "kvroute-tokenize": Policy("kvroute", plugin=TOKENIZE_CONFIG, shares=True, replicas=True),
    "kvroute-precise": Policy("kvroute", plugin=PRECISE_CONFIG, events=True, shares=True, replicas=True),
    "kvroute-precise-noshare": Policy("kvroute", plugin=PRECISE_CONFIG, events=True, replicas=True),
    "envoy-round-robin": Policy("envoy", lb="ROUND_ROBIN", default=True),
    "envoy-least-request": Policy("envoy", lb="LEAST_REQUEST"),
    "envoy-random": Policy("envoy", lb="RANDOM"),
    "envoy-ring-hash": Policy("envoy", lb="RING_HASH", default=True),  # on x-session-id
    "envoy-steer-rr": Policy("steer"),
    "envoy-steer-rr-buffered": Policy("steer", buffered=True),
    "sglang-cache-aware": Policy("sglang", replicas=True, default=True),
    "vllm-router-cache-aware": Policy("vllm-router", replicas=True, default=True),
    "oracle": Policy("oracle", default=True),
    "dynamo-kv": Policy("dynamo", events=True, default=True),
    "dynamo-kv-tuned": Policy("dynamo", events=True, tuned=True, default=True),
    "dynamo-approx": Policy("dynamo", default=True),
    "dynamo-approx-tuned": Policy("dynamo", tuned=True, default=True),
    # vllm-router's kv_aware policy, fed by the workers' KV events.
    "vllm-router-kv-aware": Policy("vllm-router", events=True, default=True),
}
POLICIES = list(POLICY)
DEFAULT_POLICIES = [n for n, p in POLICY.items() if p.default]
# The kvroute variants that add plugin settings (they also get the decode-pool cluster).
PRECISE_POLICIES = {n: p.plugin for n, p in POLICY.items() if p.plugin is not None}
# Precise mode: the workers publish KV events and every gateway's relay subscribes to all of them.
EVENT_POLICIES = [n for n, p in POLICY.items() if p.router == "kvroute" and p.events]
SHARING_POLICIES = [n for n, p in POLICY.items() if p.shares]
REPLICA_POLICIES = [n for n, p in POLICY.items() if p.replicas]
# A kvroute-tokenize / kvroute-precise cell logs when more than this share of tokenize calls
# failed (timeouts, errors: those prompts' text stays unmapped to engine blocks).
TOKENIZE_MAX_FAILED = 0.01

# The peers kvroute's targets compare against (issues 11, 43). Where two tie, the first in this
# order is the reference.
PEERS = ["sglang-cache-aware", "vllm-router-cache-aware", "envoy-ring-hash", "dynamo-kv", "dynamo-kv-tuned",
         "dynamo-approx", "dynamo-approx-tuned", "vllm-router-kv-aware"]
# Targets by scenario: goodput >= 1.2x the best peer at the 2 s SLO; >= 3x round-robin at 2 s.
TARGET_1_2X_PEER = ["shared-context", "agentic", "docqa"]
TARGET_3X_RR = ["shared-context", "docqa"]
# Issue 14: precise mode's goodput at 2 s >= 1.3x predicted mode's (plain kvroute) on the
# eviction-pressure scenario.
TARGET_PRECISE_1_3X = ["docqa"]


def parse_label(label):
    """A cell's label -> (policy, gateways): `kvroute@4` -> ("kvroute", 4), `kvroute` -> 1."""
    if "@" in label:
        pol, n = label.rsplit("@", 1)
        return pol, int(n)
    return label, 1


def expand_replicas(policies, replicas):
    """The cells' labels for --replicas: every policy at every count it can run at (see POLICY)."""
    out = []
    for pol in policies:
        for n in replicas:
            if n > 1 and pol not in REPLICA_POLICIES:
                continue
            if n == 1 and pol.endswith("-noshare") and len(replicas) > 1:
                continue
            out.append(pol if n == 1 else f"{pol}@{n}")
    return out


def steer_rr_filter(clusters, buffered):
    """An Envoy Lua filter naming the clusters in turn (per Envoy thread) in x-kvroute-cluster."""
    names = ", ".join(f'"{c}"' for c in clusters)
    code = (f"local clusters = {{{names}}}\n"
            "local n = 0\n"
            "function envoy_on_request(h)\n"
            + ("  h:body()\n" if buffered else "")
            + "  n = n % #clusters + 1\n"
            "  h:headers():replace(\"x-kvroute-cluster\", clusters[n])\n"
            "  h:clearRouteCache()\n"
            "end\n")
    return {"name": "envoy.filters.http.lua",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                             "default_source_code": {"inline_string": code}}}


def oracle_label(setting):
    """The name of one oracle setting (prefill_scale, held_weight), also its raw/ folder."""
    return f"oracle-ps{setting[0]:g}-hw{setting[1]:g}"
