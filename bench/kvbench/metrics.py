"""What a run's processes count, read over HTTP when it ends: the workers' vLLM and mock
counters, Envoy's kvroute stats (precise mode, tokenize, decision sharing, the reuse ladder) and
kvroute-relay's metrics."""

from kvstack import prom_samples

from kvbench.procs import http
from kvbench.stats import LADDER_RUNGS, hist_quantiles, merged, stat


def scrape(ws):
    """The fleet's engine counters (preemptions, prefix cache, evictions, adapter loads...),
    summed over the workers that answer."""
    tot = {}
    for w in ws:
        try:
            st, _, b = http("GET", w["url"] + "/metrics", timeout=3)
        except Exception:
            continue
        for line in b.decode().splitlines():
            for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                         "vllm:prefix_cache_queries_total", "mock:engine_lag_seconds_total",
                         "mock:kv_evicted_blocks_total", "mock:engine_passes_total",
                         "mock:engine_simulated_seconds_total", "mock:lora_loads_total"):
                if line.startswith(name + "{") or line.startswith(name + " "):
                    tot[name] = tot.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return tot


def prom(url, prefixes):
    """Samples of a Prometheus text page whose names start with one of prefixes, as
    {'name{labels}': value} ('{}' dropped)."""
    _, _, b = http("GET", url, timeout=5)
    return prom_samples(b.decode(), tuple(prefixes))


def envoy_kvroute_stats(admin):
    """Envoy's kvroute_precise_*, kvroute_tokenize_* and kvroute_peers_* stats (admin
    /stats/prometheus)."""
    return prom(admin + "/stats/prometheus", ("kvroute_precise_", "kvroute_tokenize_", "kvroute_peers_"))


def ladder_stats(admins, engines):
    """kvroute's reuse ladder at the end of a run, summed over its gateways: tokens per rung
    over the requests whose engine reported cached tokens (`reported`), the rest (`unreported`,
    no served rung), and the engines' own prefix-cache counters beside them (whole run)."""
    st = merged(prom(a + "/stats/prometheus", ("kvroute_reuse_",)) for a in admins)
    out = {kind: {r: st.get(f'kvroute_reuse_{name}_total{{rung="{r}"}}', 0.0) for r in LADDER_RUNGS
                  if r != "served" or kind == "reported"}
           for kind, name in (("reported", "tokens"), ("unreported", "unreported_tokens"))}
    out["engine_queries"] = engines.get("vllm:prefix_cache_queries_total")
    out["engine_hits"] = engines.get("vllm:prefix_cache_hits_total")
    return out


def sharing_stats(admins, relay_urls, share):
    """What the gateways shared in one run: per gateway and summed, the filter's
    kvroute_peers_{sent,dropped,received,errors,gone}_total and its peers delay histogram (us,
    decision made -> applied by a peer, Envoy's buckets: quantiles are bucket upper bounds),
    and the relays' decision counters and propagation histogram (ms)."""
    per = []
    for a in admins:
        st = prom(a + "/stats/prometheus", ("kvroute_peers_",))
        per.append(st)
    tot = merged(per)
    out = {"share": share, "gateways": len(admins), "per_gateway": []}
    for name in ("sent", "dropped", "received", "errors", "gone"):
        out["peers_" + name] = stat(tot, f"kvroute_peers_{name}_total")
    for st in per:
        out["per_gateway"].append({name: stat(st, f"kvroute_peers_{name}_total")
                                   for name in ("sent", "dropped", "received", "errors", "gone")})
    out["peers_delay_us"] = hist_quantiles(tot, "kvroute_peers_delay_us")
    out["envoy"] = tot
    if relay_urls:
        rl = merged(prom(u + "/metrics", ("kvroute_relay_decision", "kvroute_relay_nats", "kvroute_relay_peers",
                                          "kvroute_relay_streams")) for u in relay_urls)
        out["relay"] = rl
        for k in ("decisions_local_total", "decisions_published_total", "nats_messages_published_total",
                  "decisions_nats_received_total", "decisions_forwarded_total", "decisions_dropped_total",
                  "nats_errors_total"):
            out["relay_" + k] = stat(rl, "kvroute_relay_" + k)
        out["relay_propagation_ms"] = hist_quantiles(rl, "kvroute_relay_decision_propagation_ms")
    return out
