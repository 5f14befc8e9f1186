"""Prometheus samples as the suite keeps them ({'name{labels}': value}): summed over labels or
over gateways, histogram quantiles, and the one-line texts of a cell's log. Pure: the report
reads the same samples back from results.json."""

import re

# kvroute's reuse ladder (docs/diagnosing.md): the rungs its kvroute_reuse_* counters are labelled by.
LADDER_RUNGS = ("prompt", "workload", "fleet", "routed", "served")


def merged(stats):
    """Several gateways' (or relays') samples summed name by name (counters and histogram
    buckets add up; gauges become the sum)."""
    out = {}
    for st in stats:
        for k, v in st.items():
            out[k] = out.get(k, 0.0) + v
    return out


def hist_quantiles(stats, name, qs=(0.5, 0.9, 0.99)):
    """Quantiles of a Prometheus histogram from its cumulative buckets (summed over labels):
    the upper bound of the bucket each quantile falls in; None without observations."""
    buckets = {}
    for k, v in stats.items():
        if k.startswith(name + "_bucket"):
            m = re.search(r'le="([^"]+)"', k)
            if m:
                le = float("inf") if m.group(1) in ("+Inf", "inf") else float(m.group(1))
                buckets[le] = buckets.get(le, 0.0) + v
    if not buckets:
        return None
    les = sorted(buckets)
    total = buckets[les[-1]]
    out = {"count": total, "sum": stat(stats, name + "_sum")}
    for q in qs:
        out[f"p{round(q * 100)}"] = (None if not total else
                                    next((le for le in les if buckets[le] >= q * total), les[-1]))
    out["mean"] = out["sum"] / total if total else None
    return out


def stat(stats, name):
    """One stat by name, summed over its labelled series (histograms: their _sum/_count)."""
    return sum(v for k, v in stats.items() if k == name or k.startswith(name + "{"))


def sharing_text(sh):
    """One line: what the gateways of a replicas cell shared."""
    d = sh.get("peers_delay_us") or {}
    t = (f"peers sent {sh['peers_sent']:g} received {sh['peers_received']:g} dropped {sh['peers_dropped']:g} "
         f"gone {sh['peers_gone']:g}, delay p50/p90 {fmt(d.get('p50'), 0)}/{fmt(d.get('p90'), 0)} us")
    if "relay" in sh:
        pr = sh.get("relay_propagation_ms") or {}
        t += (f"; relays published {sh['relay_decisions_published_total']:g} nats-received "
              f"{sh['relay_decisions_nats_received_total']:g} dropped {sh['relay_decisions_dropped_total']:g}, "
              f"propagation p50/p90 {fmt(pr.get('p50'), 1)}/{fmt(pr.get('p90'), 1)} ms")
    return t


def fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def precise_text(p):
    """One line: tokenize calls, the stream's liveness and the event counters of a cell."""
    t = (f"tokenize ok {p.get('tokenize_ok', 0):g} failed {p.get('tokenize_failed', 0):g}"
         + (f" ({p['tokenize_failed_share']:.2%})" if p.get("tokenize_failed_share") is not None else ""))
    if "relay" not in p:
        return t
    r = p["relay"]
    return (t + f"; stream live {'yes' if p.get('stream_live_seen') else 'NO'} (min/max during run "
            f"{fmt(p.get('stream_live_min'), 0)}/{fmt(p.get('stream_live_max'), 0)}, end {p.get('stream_live_end', 0):g}), "
            f"filter stored/removed {p.get('filter_blocks_stored_total', 0):g}/{p.get('filter_blocks_removed_total', 0):g}, "
            f"stream failures {p.get('filter_stream_failures_total', 0):g}; relay stored/removed "
            f"{stat(r, 'kvroute_relay_blocks_stored_total'):g}/{stat(r, 'kvroute_relay_blocks_removed_total'):g}, gaps "
            f"repaired/unrepaired {stat(r, 'kvroute_relay_gaps_repaired_total'):g}/"
            f"{stat(r, 'kvroute_relay_gaps_unrepaired_total'):g}")
