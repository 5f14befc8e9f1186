"""What a scenario's runs add up to: goodput per policy and SLO, the main table, whether any
policy beat the oracle envelope, and the target tables (issues 11 and 43: kvroute against its
peers; 14: precise mode; 15: gateway replicas). Pure: --report-only redoes all of it from
results.json."""

from kvbench.config import fleet_split, prefill_pool
from kvbench.goodput import goodput_result, gp_text, p90
from kvbench.policies import PEERS, TARGET_1_2X_PEER, TARGET_3X_RR, TARGET_PRECISE_1_3X, parse_label
from kvbench.stats import fmt


# Issue 15: with 4 gateways, sharing on, kvroute's hit rate and goodput >= 0.95x one gateway's.
REPLICA_TARGET = 0.95
FLOOR = "both missed the SLO at the floor"


def verdict(x, ref, factor, floor, ref_bound, x_bound):
    """Goodput x against factor x goodput ref: met, missed, or undecided where a bound settles
    nothing. A '>=' goodput is a lower bound (met the SLO up to the highest load run), a '<' one
    an upper bound (missed it at the lowest); floor, ref_bound and x_bound say which."""
    if ref["kind"] == "<":
        return f"undecided ({floor})" if x["kind"] == "<" else "met"
    if x["value"] >= ref["value"] * factor * 0.99999:
        return "met" if ref["kind"] != ">=" else f"undecided ({ref_bound})"
    return "missed" if x["kind"] != ">=" else f"undecided ({x_bound})"


def analyze(cfg, res):
    """Goodput per policy and SLO (bisected where it was, else read off the sweep), the main
    table, the oracle envelope's comparison and the targets; pure, --report-only redoes it."""
    bis = {(p, s) for p, s in map(tuple, res.get("bisected", []))}
    table = []
    for pol, r in res["policies"].items():
        if "error" in r and not r.get("runs"):
            table.append(dict(policy=pol, error=r["error"]))
            continue
        r["goodput"] = {f"{s:g}": goodput_result(r, cfg, s, "bisect" if (pol, s) in bis else "sweep")
                        for s in cfg["slos"]}
        # The main SLO's goodput in offered simulated rps, as bench/signals.py reads it.
        g = r["goodput"].get(f"{cfg['slo_s']:g}")
        r["goodput_rps_sim"] = g and g["lo_rps"]
        r["goodput_interp_rps_sim"] = g and g["lo_rps"]
        if g and g["kind"] == "=" and g["interp"] is not None and g["method"] == "sweep":
            r["goodput_interp_rps_sim"] = g["lo_rps"] + (g["interp"] - g["lo"]) / (g["hi"] - g["lo"]) * (
                g["hi_rps"] - g["lo_rps"])
        main = r["runs"].get(f"{cfg['main_speed']:g}")
        if main is None:
            continue
        table.append(dict(policy=pol, requests=main["requests"], errors=main["errors"],
                          ttft_p50=main["ttft_sim_s"]["p50"], ttft_p90=main["ttft_sim_s"]["p90"],
                          ttft_p99=main["ttft_sim_s"]["p99"], tpot_p50=p90(main, "tpot_sim_s") and
                          main["tpot_sim_s"]["p50"], tpot_p90=p90(main, "tpot_sim_s"),
                          e2e_p50=main["e2e_sim_s"]["p50"], throughput=main["throughput_rps_sim"],
                          hit_rate=main["hit_rate"], max_mean=main["max_over_mean_requests"],
                          goodput=r["goodput"].get(f"{cfg['slo_s']:g}"),
                          oracle_setting=main.get("oracle_setting"),
                          preemptions=main.get("worker_metrics", {}).get("vllm:num_preemptions_total"),
                          evicted_blocks=main.get("evicted_blocks"), engine_hit_rate=main.get("engine_hit_rate"),
                          hit_rate_source=main.get("hit_rate_source", "usage")))
    res["table"] = table
    res["envelope_beaten"] = envelope_beaten(cfg, res)
    res["targets"] = (unequal_fleets(cfg, targets(cfg, res)) + pool_rows(cfg, res) + precise_targets(cfg, res)
                      + replica_targets(cfg, res))


def unequal_fleets(cfg, rows):
    """The legacy prefill_workers gives kvroute a pool its peers do not route to: its targets
    against them are shown but not judged (a gain from extra hardware is not a routing gain)."""
    m = prefill_pool(cfg)
    if not m:
        return rows
    return [dict(r, status=f"not comparable (kvroute had {m} prefill worker{'s' if m > 1 else ''} more than its peers; "
                           f"was {r['status']})") for r in rows]


def pool_rows(cfg, res):
    """kvroute-pool (its pool taken from the same workers the peers route over) against the best
    peer: TTFT p50 / p90 and hit rate at each load, goodput at each SLO. Informational rows
    (status `pool`): kvroute's targets are judged on kvroute without the pool."""
    P = res["policies"]
    kp = P.get("kvroute-pool")
    peers = [p for p in PEERS if P.get(p, {}).get("runs")]
    if not kp or not kp.get("runs") or not peers:
        return []
    d, m = fleet_split(cfg, "kvroute-pool")
    who = f"kvroute-pool ({d} decode + {m} pool of the same {cfg['workers']})"
    rows = []
    for sp in sorted(cfg["speeds"]):
        x = kp["runs"].get(f"{sp:g}")
        ys = [(P[p]["runs"][f"{sp:g}"], p) for p in peers if f"{sp:g}" in P[p]["runs"]]
        ys = [(y, p) for y, p in ys if y["ttft_sim_s"]["p50"] is not None]
        if not x or x["ttft_sim_s"]["p50"] is None or not ys:
            continue
        y, p = min(ys, key=lambda t: t[0]["ttft_sim_s"]["p50"])
        rows.append(dict(target=f"{who}: TTFT p50 / p90, hit at {cfg['load_name']} {sp:g} vs the peer with the lowest p50",
                         value=f"{fmt(x['ttft_sim_s']['p50'])} / {fmt(x['ttft_sim_s']['p90'])} s, {x['hit_rate']:.3f}",
                         reference=f"{p}: {fmt(y['ttft_sim_s']['p50'])} / {fmt(y['ttft_sim_s']['p90'])} s, "
                                   f"{y['hit_rate']:.3f}", status="pool"))
    for slo in cfg["slos"] if cfg.get("goodput") else []:
        k = (kp.get("goodput") or {}).get(f"{slo:g}")
        refs = [((P[p].get("goodput") or {}).get(f"{slo:g}"), p) for p in peers]
        refs = [t for t in refs if t[0]]
        if k and refs:
            ref, rp = max(refs, key=lambda t: t[0]["value"])
            rows.append(dict(target=f"{who}: goodput @ TTFT p90 <= {slo:g} s vs best peer", value=gp_text(k),
                             reference=f"{rp}: {gp_text(ref)}", status="pool"))
    return rows


def envelope_beaten(cfg, res):
    """Every (load, policy) whose p90 TTFT is below the oracle envelope's at that load."""
    o = res["policies"].get("oracle", {}).get("runs", {})
    out = []
    for key, orun in sorted(o.items(), key=lambda kv: float(kv[0])):
        ot = p90(orun, "ttft_sim_s")
        for pol, r in res["policies"].items():
            x = r.get("runs", {}).get(key)
            if pol == "oracle" or not x or ot is None or p90(x, "ttft_sim_s") is None:
                continue
            if p90(x, "ttft_sim_s") < ot:
                out.append(dict(load=float(key), policy=pol, p90=p90(x, "ttft_sim_s"), oracle_p90=ot,
                                oracle_setting=orun.get("oracle_setting")))
    return out


def targets(cfg, res):
    """Issue 11's targets for kvroute's default config on this scenario: rows of (target,
    kvroute's value, the reference, status met / missed / not measured)."""
    P = res["policies"]
    kv = P.get("kvroute")
    if not kv or not kv.get("runs"):
        return []
    quick = not cfg.get("goodput")
    rows = []
    peers = [p for p in PEERS if P.get(p, {}).get("runs")]

    def gp(pol, slo):
        return (P[pol].get("goodput") or {}).get(f"{slo:g}")

    def cmp_gp(name, slo, ref_pols, factor):
        k = gp("kvroute", slo)
        refs = [(gp(p, slo), p) for p in ref_pols if gp(p, slo)]
        if not k or not refs:
            rows.append(dict(target=name, value="-", reference="no runs", status="not measured"))
            return
        ref, rp = max(refs, key=lambda t: t[0]["value"])
        if quick:
            st = "not measured (quick)"
        else:
            st = verdict(k, ref, factor, "both missed the SLO at the lowest load run",
                         "the reference met the SLO up to the cap", "kvroute met the SLO up to the cap")
            # A peer that met the SLO at every load it ran may go beyond kvroute: no verdict.
            above = [p for g, p in refs if g["kind"] == ">=" and g is not ref]
            if st == "met" and above:
                st = f"undecided ({above[0]} met the SLO at every load it ran)"
        if not quick and "sweep" in (k["method"], ref["method"]):
            st += " (read off the sweep, not bisected)"
        ratio = f" = {k['value'] / ref['value']:.2f}x" if ref["value"] else ""
        rows.append(dict(target=name, value=gp_text(k) + ratio, reference=f"{rp}: {gp_text(ref)}", status=st))

    for slo in cfg["slos"]:
        cmp_gp(f"goodput @ TTFT p90 <= {slo:g} s >= best peer", slo, peers, 1.0)
    if cfg["scenario"] in TARGET_1_2X_PEER and 2.0 in cfg["slos"]:
        cmp_gp("goodput @ 2 s >= 1.2x best peer", 2.0, peers, 1.2)
    if cfg["scenario"] in TARGET_3X_RR and 2.0 in cfg["slos"] and P.get("envoy-round-robin", {}).get("runs"):
        cmp_gp("goodput @ 2 s >= 3x round-robin", 2.0, ["envoy-round-robin"], 3.0)
    speeds = sorted(cfg["speeds"])
    # Hit rate at every load of the sweep against the best peer's there.
    worst = None
    for sp in speeds:
        x = kv["runs"].get(f"{sp:g}")
        ph = [(P[p]["runs"][f"{sp:g}"]["hit_rate"], p) for p in peers if f"{sp:g}" in P[p].get("runs", {})]
        if x and ph:
            h, p = max(ph)
            d = x["hit_rate"] - h
            if worst is None or d < worst[0]:
                worst = (d, sp, x["hit_rate"], h, p)
    if worst:
        d, sp, h, ph, p = worst
        rows.append(dict(target="hit rate >= best peer's (-0.01) at every load", value=f"{h:.3f} at {sp:g}",
                         reference=f"{p}: {ph:.3f} (worst load)", status="met" if d >= -0.01 else "missed"))
    # Median TTFT below every other router's at every load of the sweep (from its first, about
    # half of round-robin's saturation).
    others = [p for p in P if p != "oracle" and not p.startswith("kvroute") and P[p].get("runs")]
    fails, n = [], 0
    for sp in speeds:
        x = kv["runs"].get(f"{sp:g}")
        for p in others:
            y = P[p]["runs"].get(f"{sp:g}")
            if x and y and x["ttft_sim_s"]["p50"] is not None and y["ttft_sim_s"]["p50"] is not None:
                n += 1
                if not x["ttft_sim_s"]["p50"] < y["ttft_sim_s"]["p50"]:
                    fails.append(f"{p} at {sp:g}: {y['ttft_sim_s']['p50']:.3f} <= {x['ttft_sim_s']['p50']:.3f}")
    if n:
        rows.append(dict(target="TTFT p50 below every other router at every load", value=f"{n - len(fails)}/{n} comparisons",
                         reference="; ".join(fails) if fails else ", ".join(others), status="missed" if fails else "met"))
    mm = [(kv["runs"][f"{sp:g}"]["max_over_mean_requests"], sp) for sp in speeds if f"{sp:g}" in kv["runs"]]
    if mm:
        m, sp = max(mm)
        rows.append(dict(target="max/mean requests per worker <= 1.5 at every load", value=f"{m:.2f} (at {sp:g})",
                         reference="", status="met" if m <= 1.5 else "missed"))
    return rows


def precise_targets(cfg, res):
    """Issue 14: kvroute-precise's goodput at the 2 s SLO against predicted mode's (kvroute) on
    the eviction-pressure scenario; kvroute-tokenize's ratio is shown alongside."""
    P = res["policies"]
    if cfg["scenario"] not in TARGET_PRECISE_1_3X or 2.0 not in cfg["slos"]:
        return []
    quick = not cfg.get("goodput")

    def gp(pol):
        return (P.get(pol, {}).get("goodput") or {}).get("2")

    k = gp("kvroute")
    rows = []
    for pol, factor in (("kvroute-precise", 1.3), ("kvroute-tokenize", None)):
        x = gp(pol)
        name = (f"{pol} goodput @ 2 s >= {factor:g}x kvroute (predicted)" if factor
                else f"{pol} goodput @ 2 s vs kvroute (predicted), for reference")
        if not P.get(pol, {}).get("runs"):
            if factor:
                rows.append(dict(target=name, value="-", reference="no runs", status="not measured"))
            continue
        if not x or not k:
            rows.append(dict(target=name, value="-", reference="kvroute did not run", status="not measured"))
            continue
        ratio = f" = {x['value'] / k['value']:.2f}x" if k["value"] else ""
        if not factor:
            st = "info"
        elif quick:
            st = "not measured (quick)"
        else:
            st = verdict(x, k, factor, FLOOR, "kvroute met the SLO up to the cap", f"{pol} met the SLO up to the cap")
        if factor and not quick and "sweep" in (k["method"], x["method"]):
            st += " (read off the sweep, not bisected)"
        rows.append(dict(target=name, value=gp_text(x) + ratio, reference=f"kvroute: {gp_text(k)}", status=st))
    return rows


def replica_targets(cfg, res):
    """Issue 15: with the most gateways run (4 asked), kvroute's hit rate at every load and its
    goodput at the main SLO (--slo, 2 s) >= 0.95x one gateway's on the same fleet and load, sharing on; the
    sharing-off figures (kvroute-noshare) beside them as info rows. The same for precise mode."""
    P = res["policies"]
    rows = []
    ns = sorted({parse_label(p)[1] for p in P})
    if ns == [1]:
        return rows
    quick = not cfg.get("goodput")
    for base, off in (("kvroute", "kvroute-noshare"), ("kvroute-precise", "kvroute-precise-noshare")):
        one = P.get(base, {})
        if not one.get("runs"):
            continue
        for pol in (base, off):
            n = max((parse_label(p)[1] for p in P if parse_label(p)[0] == pol and P[p].get("runs")), default=1)
            x = P.get(f"{pol}@{n}", {})
            if n == 1 or not x.get("runs"):
                continue
            info = pol == off
            # Hit rate: the worst load's ratio.
            worst = None
            for key, r1 in sorted(one["runs"].items(), key=lambda kv: float(kv[0])):
                rn = x["runs"].get(key)
                if rn and r1["hit_rate"]:
                    q = rn["hit_rate"] / r1["hit_rate"]
                    if worst is None or q < worst[0]:
                        worst = (q, key, rn["hit_rate"], r1["hit_rate"])
            if worst:
                q, key, hn, h1 = worst
                rows.append(dict(target=f"{pol}@{n} hit rate >= {REPLICA_TARGET:g}x {base} (1 gateway) at every load"
                                 + (" [sharing off, for reference]" if info else ""),
                                 value=f"{hn:.3f} at {key} = {q:.3f}x", reference=f"{base}: {h1:.3f} (worst load)",
                                 status="info" if info else "met" if q >= REPLICA_TARGET else "missed"))
            slo = f"{cfg['slo_s']:g}"
            g1 = (one.get("goodput") or {}).get(slo)
            gn = (x.get("goodput") or {}).get(slo)
            name = (f"{pol}@{n} goodput @ {slo} s >= {REPLICA_TARGET:g}x {base} (1 gateway)"
                    + (" [sharing off, for reference]" if info else ""))
            if not g1 or not gn:
                rows.append(dict(target=name, value="-", reference="no goodput", status="not measured"))
                continue
            ratio = f" = {gn['value'] / g1['value']:.2f}x" if g1["value"] else ""
            if info:
                st = "info"
            elif g1["kind"] == ">=" and gn["kind"] == ">=" and gn["lo"] >= g1["lo"]:
                st = "met (both met the SLO at every load run: a lower bound)"
            else:
                st = verdict(gn, g1, REPLICA_TARGET, FLOOR, "1 gateway met the SLO up to the highest load",
                             "met the SLO up to the highest load")
            if "sweep" in (g1["method"], gn["method"]):
                st += " (read off the sweep" + (", quick preset" if quick else "") + ")"
            rows.append(dict(target=name, value=gp_text(gn) + ratio, reference=f"{base}: {gp_text(g1)}", status=st))
    # Issue 14 at N gateways without sharing: the engines' events still show every gateway the
    # whole fleet's cache, predictions only what the gateway itself routed.
    if cfg["scenario"] in TARGET_PRECISE_1_3X:
        for pol in P:
            base, n = parse_label(pol)
            k = P.get(f"kvroute-noshare@{n}", {})
            if base != "kvroute-precise-noshare" or n == 1 or not k.get("runs") or not P[pol].get("runs"):
                continue
            x, y = (P[pol].get("goodput") or {}).get("2"), (k.get("goodput") or {}).get("2")
            if not x or not y:
                continue
            ratio = f" = {x['value'] / y['value']:.2f}x" if y["value"] else ""
            st = verdict(x, y, 1.3, FLOOR, "kvroute-noshare met the SLO up to the cap", "met the SLO up to the cap")
            if "sweep" in (x["method"], y["method"]):
                st += " (read off the sweep)"
            rows.append(dict(target=f"{pol} goodput @ 2 s >= 1.3x kvroute-noshare@{n} (issue 14, {n} gateways)",
                             value=gp_text(x) + ratio, reference=f"kvroute-noshare@{n}: {gp_text(y)}", status=st))
    return rows


def annotate(sres):
    """Stamps every run with its scenario, split and seed or slice, and the scenario with its
    reuse ceiling."""
    cfg = sres["config"]
    for p in sres["policies"].values():
        for r in p.get("runs", {}).values():
            r.update(scenario=cfg["scenario"], split=cfg["split"], split_label=cfg["split_label"])
            if cfg["workload"] == "mooncake":
                r.update(trace=cfg["trace"], start=cfg["start"], count=cfg["count"])
            else:
                r["seed"] = cfg["seed"]
    # The infinite-cache ceiling depends only on the requests sent, the same in every run of a
    # split up to the replies' text; the median over runs stands for the scenario.
    for key in ("reuse_ceiling", "reuse_ceiling_all"):
        v = sorted(r[key] for p in sres["policies"].values() for r in p.get("runs", {}).values()
                   if r.get(key) is not None)
        sres[key] = v[len(v) // 2] if v else None
        sres[key + "_range"] = [v[0], v[-1]] if v else None
