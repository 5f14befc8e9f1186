"""results.md from a results.json: the scenario and summary tables, the targets, then per
scenario every policy at the main load, goodput and its bisection, the sweep, the oracle
envelope, precise mode, the reuse ladder, gateway replicas; the overhead tables."""

import os

from kvbench.config import OVERHEAD_SIZES, fleet_split, mock_args, overhead_cells, prefill_pool
from kvbench.goodput import gp_text, p90, per_repeat_text
from kvbench.paths import ROOT
from kvbench.policies import EVENT_POLICIES, PRECISE_POLICIES, TOKENIZE_MAX_FAILED, parse_label
from kvbench.stats import LADDER_RUNGS, fmt, stat


def pool_note(cfg, policies=()):
    """How results.md names the fleets' prefill pools: the engines' hit rate counts a handed-off
    prompt twice (prefill worker, then the decode worker that receives its KV), so it is not
    comparable with a fleet without one."""
    m = prefill_pool(cfg)
    if m:
        return (f" ({cfg['workers'] - m} decode, {m} a prefill pool (`--role prefill`), kvroute's disaggregation on; "
                "other policies route to the decode workers only, so kvroute had more workers than they did; "
                "hit rates count a handed-off prompt on both sides)")
    if "kvroute-pool" in policies:
        d, m = fleet_split(cfg, "kvroute-pool")
        return (f"; every policy routes over all {cfg['workers']} except kvroute-pool: {d} decode + {m} of the same "
                f"{cfg['workers']} a prefill pool (`--role prefill`, kvroute's disaggregation on; its hit rate counts "
                "a handed-off prompt on both sides)")
    return ""


def replicas_markdown(res):
    """Scenario x policy x gateways: hit rate and TTFT p50 / p90 at each load, goodput at the
    main SLO and its ratio to one gateway's; then what the gateways shared."""
    L = []
    for n, s in res["scenarios"].items():
        P = s["policies"]
        if not any("@" in p for p in P):
            continue
        c = s["config"]
        speeds = sorted(c["speeds"])
        slo = f"{c['slo_s']:g}"
        L += ["", f"## Gateway replicas: {n}", "",
              f"Hit rate, TTFT p50 / p90 (simulated s) at each {c['load_name']}, goodput @ TTFT p90 <= {slo} s "
              "(x one gateway's: kvroute-noshare and kvroute-precise-noshare against kvroute and kvroute-precise). "
              "N > 1: N gateways behind one plain Envoy (ROUND_ROBIN over the gateways, request by request).", "",
              "| policy | gateways | " + " | ".join(f"{c['load_name']} {sp:g}: hit | TTFT p50 / p90" for sp in speeds)
              + f" | goodput @ {slo} s | x 1 gateway |",
              "|---|---|" + "---|---|" * len(speeds) + "---|---|"]
        pols = sorted(P, key=lambda p: (SUMMARY_POLICIES.index(parse_label(p)[0].replace("-noshare", ""))
                                        if parse_label(p)[0].replace("-noshare", "") in SUMMARY_POLICIES else 99,
                                        parse_label(p)[1], "-noshare" in p))
        for pol in pols:
            r = P[pol]
            base, k = parse_label(pol)
            cells = []
            for sp in speeds:
                x = r.get("runs", {}).get(f"{sp:g}")
                if not x:
                    cells.append("- | -")
                    continue
                err = "" if x["errors"] == 0 else f" ({x['errors']} err)"
                cells.append(f"{x['hit_rate']:.3f} | {fmt(x['ttft_sim_s']['p50'], 2)} / {fmt(x['ttft_sim_s']['p90'], 2)}{err}")
            g = (r.get("goodput") or {}).get(slo)
            ref = (P.get(base.replace("-noshare", ""), {}).get("goodput") or {}).get(slo)
            ratio = "-"
            if g and ref and ref["value"]:
                ratio = f"{g['value'] / ref['value']:.2f}"
                if ">=" in (g["kind"], ref["kind"]) and not (g["kind"] == ref["kind"] == ">=" and g["lo"] == ref["lo"]):
                    # A lower bound against another load's: no ratio.
                    ratio = "- (bound)" if g["lo"] != ref["lo"] else ratio
                elif g["kind"] == ref["kind"] == ">=":
                    ratio = "1.00 (both bounds)"
            if "error" in r and not r.get("runs"):
                cells = [f"error: {r['error'][:80]}"] + ["-"] * (2 * len(speeds) - 1)
            L.append(f"| {base} | {k} | " + " | ".join(cells) + f" | {gp_text(g)} | {ratio} |")
        rows = []
        for pol in pols:
            for key, x in sorted(P[pol].get("runs", {}).items(), key=lambda kv: float(kv[0])):
                sh = x.get("sharing")
                if not sh:
                    continue
                d = sh.get("peers_delay_us") or {}
                pr = sh.get("relay_propagation_ms") or {}

                def rv(k, sh=sh):
                    return f"{sh[k]:g}" if k in sh else "-"
                rows.append(f"| {pol} | {key} | {'on' if sh['share'] else 'off'} | {sh['peers_sent']:g} | "
                            f"{sh['peers_received']:g} | {sh['peers_dropped']:g} | {sh['peers_errors']:g} | "
                            f"{sh['peers_gone']:g} | {fmt(d.get('p50'), 0)} / {fmt(d.get('p90'), 0)} / "
                            f"{fmt(d.get('p99'), 0)} ({fmt(d.get('mean'), 0)}) | {rv('relay_decisions_published_total')} | "
                            f"{rv('relay_decisions_nats_received_total')} | {rv('relay_decisions_dropped_total')} | "
                            f"{fmt(pr.get('p50'), 1)} / {fmt(pr.get('p90'), 1)} / {fmt(pr.get('p99'), 1)} "
                            f"({fmt(pr.get('mean'), 2)}) |")
        if rows:
            L += ["", "Decision sharing (end of each run, summed over the gateways):", "",
                  f"| cell | {c['load_name']} | sharing | peers sent | peers received | dropped | errors | gone | "
                  "peer delay p50 / p90 / p99 (mean), us | relays published | relays received from NATS | relays "
                  "dropped | relay propagation p50 / p90 / p99 (mean), ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"] + rows + [
                  "", "Envoy stats `kvroute_peers_*` (admin /stats/prometheus; sent: replication messages a "
                  "gateway handed its relay, received: the routing events in the peers' messages it applied, so "
                  "with N gateways about N-1 times sent x events per message; the delay "
                  "histogram's quantiles are the upper bounds of Envoy's default buckets, the mean is exact), kvroute-relay's `kvroute_relay_decision*` "
                  "(propagation: the decision's send time at the peer gateway -> the Update handed to this gateway's "
                  "stream). Per gateway in results.json (`runs.<load>.sharing`)."]
        t = [x for x in s.get("targets") or [] if "gateway" in x["target"]]
        if t:
            L += ["", "Issue 15's targets:", "", "| target | value | reference | status |", "|---|---|---|---|"]
            L += [f"| {x['target']} | {x['value']} | {x['reference']} | **{x['status']}** |" for x in t]
    return L


def ladder_markdown(cfg, res):
    """kvroute's reuse ladder per run (docs/diagnosing.md): each rung's share of the prompt
    tokens of the requests with usage, and the engines' own hit rate beside `served`."""
    rows = []
    for pol, r in res["policies"].items():
        for key, x in sorted(r.get("runs", {}).items(), key=lambda kv: float(kv[0].split("_")[0])):
            lad = x.get("ladder")
            if not lad:
                continue
            rp, un = lad["reported"], lad["unreported"]
            n = rp["prompt"] or 1.0
            q, h = lad.get("engine_queries"), lad.get("engine_hits")
            engine_rate = f"{h / q:.3f}" if q else "-"
            vs_engine = f"{rp['served'] / h:.3f}" if h else "-"
            rows.append(f"| {pol} | {key} | {rp['prompt']:.0f} | "
                        + " | ".join(f"{rp[g] / n:.3f}" for g in LADDER_RUNGS[1:])
                        + f" | {engine_rate} | {vs_engine} | {un['prompt']:.0f} |")
    if not rows:
        return []
    return ["", "### Reuse ladder (kvroute, end of each run)", "",
            f"| policy | {cfg['load_name']} | prompt tokens with usage | workload | fleet | routed | served | "
            "engines' hit rate | served / engines' hits | prompt tokens without usage |",
            "|---|---|---|---|---|---|---|---|---|---|"] + rows + [
            "", "Rungs as shares of the prompt tokens whose engine reported cached tokens (warm-up included): "
            "workload - fleet is the capacity loss, fleet - routed the load-balancing trade, routed - served the "
            "index error (docs/diagnosing.md). The engines' counters cover every request, those without usage too.",
            ""]


def precise_markdown(cfg, res):
    """Per kvroute-tokenize / kvroute-precise run: tokenize calls, the relay stream, the event
    counters of the filter (Envoy stats) and of kvroute-relay (its /metrics), at the run's end."""
    rows = []
    for pol in [p for p in res["policies"] if parse_label(p)[0] in PRECISE_POLICIES]:
        r = res["policies"].get(pol, {})
        for key, x in sorted(r.get("runs", {}).items(), key=lambda kv: float(kv[0])):
            p = x.get("precise")
            if not p:
                continue
            rl = p.get("relay") or {}

            def rv(name, rl=rl):
                return f"{stat(rl, 'kvroute_relay_' + name):g}" if rl else "-"
            share = p.get("tokenize_failed_share")
            live = ("-" if parse_label(pol)[0] not in EVENT_POLICIES else
                    f"{'yes' if p.get('stream_live_seen') else '**no**'} ({fmt(p.get('stream_live_min'), 0)}/"
                    f"{fmt(p.get('stream_live_max'), 0)}/{p.get('stream_live_end', 0):g})")
            rows.append(f"| {pol} | {key} | {p.get('tokenize_ok', 0):g} | {p.get('tokenize_failed', 0):g} | "
                        f"{'-' if share is None else f'{share:.2%}'} | {live} | "
                        f"{p.get('filter_blocks_stored_total', 0):g} / {p.get('filter_blocks_removed_total', 0):g} | "
                        f"{p.get('filter_stream_failures_total', 0):g} | {rv('blocks_stored_total')} / "
                        f"{rv('blocks_removed_total')} | {rv('gaps_repaired_total')} / {rv('gaps_unrepaired_total')} | "
                        f"{rv('engine_restarts_total')} |")
    if not rows:
        return []
    return ["", "### Precise mode and tokenization (end of each run)", "",
            f"| policy | {cfg['load_name']} | tokenize ok | tokenize failed | failed share | stream live "
            "(min/max during run/end) | filter blocks stored / removed | filter stream failures | relay blocks "
            "stored / removed | relay gaps repaired / unrepaired | relay engine restarts |",
            "|---|---|---|---|---|---|---|---|---|---|---|"] + rows + [
            "", "Envoy stats `kvroute_tokenize_{ok,failed}_total` and `kvroute_precise_*` (admin "
            "/stats/prometheus, summed over labels), kvroute-relay's `kvroute_relay_*` (/metrics). A cell fails "
            f"when the stream never went live or more than {TOKENIZE_MAX_FAILED:.0%} of the tokenize calls "
            "failed. Stream live: the gauge's min/max over 1 s samples while loadgen ran, and at the end (1: live). "
            "Every run's "
            "full stat dump is in results.json (`runs.<load>.precise`)."]


SUMMARY_POLICIES = ["kvroute", "kvroute-pool", "kvroute-noshare", "kvroute-precise-noshare", "kvroute-tuned", "kvroute-tokenize", "kvroute-precise", "sglang-cache-aware", "vllm-router-cache-aware", "envoy-round-robin",
                    "envoy-ring-hash", "envoy-least-request", "envoy-random", "envoy-steer-rr",
                    "envoy-steer-rr-buffered", "oracle"]


def row_label(cfg, label):
    """A summary row's policy, with its workers where not every row had the same ones: `kvroute-pool
    (6 + 2 pool)`; with the legacy prefill_workers, kvroute's rows `(6 + 2 pool)`, the others `(6)`."""
    pol = parse_label(label)[0]
    d, m = fleet_split(cfg, pol)
    if not m and not prefill_pool(cfg):
        return label
    return f"{label} ({d} + {m} pool)" if m and pol.startswith("kvroute") else f"{label} ({d})"


def summary_markdown(res):
    """Scenario x policy: TTFT p50 / p90, hit rate and max/mean requests at each load."""
    sc = [(n, s) for n, s in res["scenarios"].items() if s["policies"]]
    if not sc:
        return []
    nl = max(len(s["config"]["speeds"]) for _, s in sc)
    L = ["## Scenarios", "",
         "| scenario | split | KV blocks/worker | reuse ceiling (run / measured) | description |", "|---|---|---|---|---|"]
    for n, s in sc:
        c = s["config"]
        L.append(f"| {n} | {s['split']} ({s['split_label']}) | {c['kv_blocks']} | {fmt(s.get('reuse_ceiling_all'))} / "
                 f"{fmt(s.get('reuse_ceiling'))} | {s['description']} |")
    L += ["", "Reuse ceiling: share of prompt tokens an infinite prefix cache shared by the fleet would serve for "
          "exactly the requests sent (loadgen re-tokenizes every prompt as the mock does and hashes 16-token "
          "blocks), over the whole run (compare with the engines' hit rate, `*`) and after the warm-up.", "",
          "## Summary (TTFT simulated s; hit rate; max/mean requests per worker)", "",
          "| scenario | policy | " + " | ".join(f"load {i + 1} (offered rps) | TTFT p50 / p90 | hit | max/mean"
                                             for i in range(nl)) + " |",
          "|---|---|" + "---|---|---|---|" * nl]
    for n, s in sc:
        c = s["config"]
        pols = sorted(s["policies"], key=lambda p: (SUMMARY_POLICIES.index(parse_label(p)[0])
                                                    if parse_label(p)[0] in SUMMARY_POLICIES else 99, parse_label(p)[1]))
        for pol in pols:
            r = s["policies"][pol]
            cells = []
            for sp in sorted(c["speeds"]):
                x = r.get("runs", {}).get(f"{sp:g}")
                if not x:
                    cells.append(f"{c['load_name']} {sp:g} | - | - | -")
                    continue
                load = f"{c['load_name']} {sp:g} ({x['offered_rps_sim']:.1f})"
                hs = "*" if x.get("hit_rate_source") == "engine" else ""
                err = "" if x["errors"] == 0 else f" ({x['errors']} err)"
                cells.append(f"{load} | {fmt(x['ttft_sim_s']['p50'], 2)} / "
                             f"{fmt(x['ttft_sim_s']['p90'], 2)}{err} | {x['hit_rate']:.3f}{hs} | "
                             f"{x['max_over_mean_requests']:.2f}")
            cells += ["- | - | - | -"] * (nl - len(cells))
            L.append(f"| {n} | {row_label(c, pol)} | " + " | ".join(cells) + " |")
    L += ["", "## Targets (kvroute, default config)", ""]
    if any(s["split"] != "heldout" for _, s in sc):
        L += ["Not the held-out split: the targets are judged on held-out runs; these are for tuning.", ""]
    L += ["| scenario | target | kvroute | reference | status |", "|---|---|---|---|---|"]
    for n, s in sc:
        if not s.get("targets"):
            L.append(f"| {n} | all | kvroute did not run | | **not measured** |")
        for t in s.get("targets") or []:
            L.append(f"| {n} | {t['target']} | {t['value']} | {t['reference']} | **{t['status']}** |")
    st = [t["status"] for _, s in sc for t in s.get("targets") or []]
    # "met (read off the sweep, not bisected)" is met too, and a missed one missed.
    L += ["", f"{sum(x.startswith('met') for x in st)} met, {sum(x.startswith('missed') for x in st)} missed, "
          f"{sum(x.startswith('undecided') for x in st)} undecided, "
          f"{sum(x.startswith('not measured') for x in st)} not measured. Goodput targets compare the "
          "load knob (bisected where the full preset ran it, see each scenario); `undecided`: a bound at the "
          "cap or the floor of the search does not settle it."
          + (" `pool`: kvroute-pool's own rows (its prefill pool is part of the same workers the peers route "
             "over), shown, not judged: the targets are kvroute's without the pool." if "pool" in st else "")
          + (" `not comparable`: kvroute had a prefill pool (`prefill_workers`) its peers did not route to."
             if any(x.startswith("not comparable") for x in st) else "")]
    beat = [f"{n}: {b['policy']} at {b['load']:g}" for n, s in sc for b in s.get("envelope_beaten") or []]
    if beat:
        L += ["", "**The oracle envelope was beaten** (p90 TTFT below the best oracle setting at the same load) by "
              + "; ".join(beat) + "."]
    return L + [""]


def write_markdown(res, path):
    L = [f"# Benchmark results: {res['name']}", "",
         f"Command: `{res['command']}`  ", f"Date: {res['date']}, wall time {res['wall_s']:.0f} s "
         f"({res['wall_s'] / 60:.1f} min), split {res['split']}  ",
         "All times are simulated seconds (wall x speedup); rates are simulated requests/s.", ""]
    b = res.get("builds") or {}
    if b:
        L += ["Builds: " + ", ".join(f"{k} `{os.path.relpath(v['path'], ROOT) if v['path'].startswith(ROOT) else v['path']}` "
                                     f"sha256 {v['sha256'][:12]} ({v['mtime']} UTC)"
                                     for k, v in b.items() if isinstance(v, dict))
              + (f"; tree at {b['git_head'][:7]}" if b.get("git_head") else ""), ""]
    L += summary_markdown(res)
    L += replicas_markdown(res)
    for s in res["scenarios"].values():
        L += scenario_markdown(s["config"], s)
    ov = res.get("overhead")
    if ov:
        L += overhead_markdown(ov)
    if res.get("not_run"):
        L += ["", "## Could not run", ""] + [f"- {k}: {v}" for k, v in res["not_run"].items()]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def scenario_markdown(cfg, res):
    if cfg["workload"] == "mooncake":
        wl = (f"Mooncake {cfg['trace']} {cfg['split_label']} (first {cfg['warmup']} not measured), trace blocks "
              f"of 512 tokens replayed as {cfg['block_tokens']}, max_tokens <= {cfg['max_output']}, prompts <= "
              f"{cfg['max_input_tokens']} tokens; load = trace speed factor"
              + (f"; burst `{cfg['burst']}` (loadgen --burst AT:LEN:F)" if cfg.get("burst") else ""))
    else:
        more = (f" (above load {cfg['sessions'] / cfg['window_s']:g}: load x {cfg['window_s']:.3g} s of arrivals)"
                if cfg.get("window_s") else "")
        wl = (f"synthetic, {cfg['split_label']}, {cfg['sessions']} sessions{more} of {cfg['turns'][0]}-{cfg['turns'][1]} "
              f"turns, think {cfg['think_s']:g} s, `{' '.join(cfg['loadgen_args'])}`, max_tokens <= "
              f"{cfg['max_output']} (first {cfg['warmup']} requests not measured); load = new sessions per "
              "simulated second")
    L = ["", f"## Scenario {cfg['scenario']} ({cfg['split']})", "", cfg["description"] + "  ",
         f"Fleet: {cfg['workers']} mock workers{pool_note(cfg, res.get('policies') or ())}, Dynamo timing model, --speedup {cfg['speedup']:g}, "
         f"`{' '.join(mock_args(cfg))}` ({cfg['kv_blocks']} blocks x {cfg['block_size']} tokens of KV each)  ",
         f"Workload: {wl}  ",
         f"Infinite-cache reuse ceiling: {fmt(res.get('reuse_ceiling_all'))} of prompt tokens over the run, "
         f"{fmt(res.get('reuse_ceiling'))} after the warm-up; {res['wall_s']:.0f} s wall"
         + (f" ({res['runs']} runs, sweep {res['sweep_wall_s']:.0f} s)" if res.get("runs") else ""), ""]
    bud = res.get("budget") or {}
    if bud.get("skipped") or bud.get("cut"):
        def jobs_text(js):
            return ", ".join(f"{p} at {s:g} s" for p, s in js) or "none"
        L += [f"Time budget (`budget_min`, this scenario's share {bud['allowance_s']} s): close calls not "
              f"bisected, read off the sweep: {jobs_text(bud['skipped'])}; bisection or repeats cut short "
              f"(the bracket reached): {jobs_text(bud['cut'])}.", ""]
    L += [
         f"### Policies at {cfg['load_name']} {cfg['main_speed']:g} (main point)", "",
         "| policy | ok/req | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p90 | E2E p50 | done rps | hit rate | max/mean req | "
         f"goodput @ TTFT p90 <= {cfg['slo_s']:g} s | preempt | evicted blocks |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in res["table"]:
        if "error" in t:
            L.append(f"| {t['policy']} | could not run: {t['error'][:120]} ||||||||||||")
            continue
        pol = t["policy"] + (f" ({t['oracle_setting']})" if t.get("oracle_setting") else "")
        L.append(f"| {pol} | {t['requests'] - t['errors']}/{t['requests']} | {fmt(t['ttft_p50'])} | "
                 f"{fmt(t['ttft_p90'])} | {fmt(t['ttft_p99'])} | {fmt(t['tpot_p90'], 4)} | {fmt(t['e2e_p50'], 2)} | "
                 f"{t['throughput']:.2f} | {t['hit_rate']:.3f}{'*' if t['hit_rate_source'] == 'engine' else ''} | "
                 f"{t['max_mean']:.2f} | {gp_text(t['goodput'])} | "
                 f"{'-' if t['preemptions'] is None else int(t['preemptions'])} | "
                 f"{'-' if t['evicted_blocks'] is None else int(t['evicted_blocks'])} |")
    L += ["", "Hit rate: cached / prompt tokens from usage.prompt_tokens_details (requests after the warm-up); "
          "`*`: the workers do not report cached_tokens (vLLM's default), so it is the engines' own "
          "vllm:prefix_cache_hits / queries over the whole run. TPOT: (E2E - TTFT) / (output tokens - 1) per "
          "request. preempt: vllm:num_preemptions summed over the fleet; evicted blocks: cached KV blocks the "
          "fleet evicted to make room (mock:kv_evicted_blocks).", ""]
    L += goodput_markdown(cfg, res)
    L += ["", "### Sweep (TTFT p90, simulated s, by offered load)", "",
          "| policy | " + " | ".join(f"{cfg['load_name']} {s:g}" for s in cfg["speeds"]) + " |",
          "|---|" + "---|" * len(cfg["speeds"])]
    for pol, r in res["policies"].items():
        if not r.get("runs"):
            continue
        cells = []
        for s in cfg["speeds"]:
            x = r["runs"].get(f"{s:g}")
            cells.append("-" if not x else f"{fmt(x['ttft_sim_s']['p90'])} @ {x['offered_rps_sim']:.1f} rps"
                         + ("" if x["errors"] == 0 else f" ({x['errors']} err)")
                         + (f" ({x['oracle_setting']})" if x.get("oracle_setting") else ""))
        L.append(f"| {pol} | " + " | ".join(cells) + " |")
    L += envelope_markdown(cfg, res)
    L += precise_markdown(cfg, res)
    L += ladder_markdown(cfg, res)
    L += ["", "### Targets (kvroute, default config)", ""]
    if not res.get("targets"):
        L.append("kvroute did not run on this scenario: no targets.")
    else:
        if res["split"] != "heldout":
            L += [f"Split {res['split']}: the targets are judged on the held-out split; these are for tuning.", ""]
        L += ["| target | kvroute | reference | status |", "|---|---|---|---|"]
        for t in res["targets"]:
            L.append(f"| {t['target']} | {t['value']} | {t['reference']} | **{t['status']}** |")
    return L


def goodput_markdown(cfg, res):
    """Goodput per policy and TTFT SLO, with how it was found."""
    pols = [p for p, r in res["policies"].items() if r.get("goodput")]
    if not pols:
        return []
    L = [f"### Goodput (highest offered load, {cfg['load_name']}, with p90 TTFT <= SLO, p90 TPOT <= "
         f"{cfg['tpot_slo_s']:g} s and < 1 % errors)", "",
         "| policy | " + " | ".join(f"TTFT <= {s:g} s" for s in cfg["slos"]) + " |",
         "|---|" + "---|" * len(cfg["slos"])]
    for pol in pols:
        L.append(f"| {pol} | " + " | ".join(gp_text(res["policies"][pol]["goodput"].get(f"{s:g}"))
                                           for s in cfg["slos"]) + " |")
    L += ["", "Bisected cells: the load of the last run that met the SLO (its offered simulated rps in "
          f"brackets), bisected to {cfg['goodput_tol'] * 100:g} % of the load; `[bracket a-b]` when the probe "
          "budget ran out first; `>= x`: met at every load run, x the highest (bisected: the cap, "
          f"{cfg['goodput_cap']:g}x the highest load of the sweep); `< x`: missed even at x, the lowest load run "
          f"(bisected: the floor, {cfg['goodput_floor']:g}x the lowest of the sweep). `~x (a-b)`: not bisected, "
          "read off the sweep (met at a, missed at b, interpolated crossing x). "
          "`repeats a/b`: the goodput each repeat of the deciding loads gives, when they disagree.", ""]
    rep = []
    for pol in pols:
        for sk, g in res["policies"][pol]["goodput"].items():
            if g and g.get("repeats", 1) > 1:
                parts = [f"{tag} {g[tag]:g}: p90 {g[tag + '_p90_range'][0]:.3f}-{g[tag + '_p90_range'][1]:.3f} s"
                         for tag in ("lo", "hi") if g.get(tag) is not None and g.get(tag + "_p90_range")]
                rep.append(f"| {pol} | {sk} | {g['probes'] or 0} | {g['repeats']} | {'; '.join(parts)} | "
                           f"{per_repeat_text(g)} |")
    if rep:
        L += ["Bisection: probes beyond the sweep and the spread over the repeats of the deciding loads "
              "(lo: last met, hi: first missed).", "",
              "| policy | SLO s | probes | runs per deciding load | p90 TTFT min-max | goodput per repeat |",
              "|---|---|---|---|---|---|"] + rep + [""]
    return L


def envelope_markdown(cfg, res):
    sw = res.get("oracle_sweep")
    if not sw:
        return []
    keys = sorted({k for o in sw.values() for k in o["runs"] if "_r" not in k}, key=float)
    L = ["", "### Oracle envelope (p90 TTFT by setting; the oracle's row is the best at each load)", "",
         "| setting (prefill_scale, held_weight) | " + " | ".join(f"{cfg['load_name']} {k}" for k in keys) + " |",
         "|---|" + "---|" * len(keys)]
    orr = res["policies"].get("oracle", {}).get("runs", {})
    for lab, o in sw.items():
        cells = []
        for k in keys:
            x = o["runs"].get(k)
            won = orr.get(k, {}).get("oracle_setting") == lab
            cells.append("-" if not x else ("**" if won else "") + fmt(p90(x, "ttft_sim_s")) + ("**" if won else ""))
        L.append(f"| {lab} ({o['setting'][0]:g}, {o['setting'][1]:g}) | " + " | ".join(cells) + " |")
    beaten = res.get("envelope_beaten") or []
    L.append("")
    if beaten:
        L.append("**The oracle envelope is beaten** (p90 TTFT below the best oracle setting at the same load): "
                 + "; ".join(f"{b['policy']} at {b['load']:g}: {b['p90']:.3f} s < {b['oracle_p90']:.3f} s "
                             f"({b['oracle_setting']})" for b in beaten) + ".")
    else:
        L.append("No policy beat the oracle envelope's p90 TTFT at any load.")
    return L


def overhead_markdown(ov):
    L = []
    if ov:
        L += ["", "## Overhead (one instant worker, non-streaming, max_tokens 1, 1 client, paths interleaved; wall ms)", "",
              "| path | " + " | ".join(f"{n // 1000}k {kind} p50 / p99" for _, kind, n in overhead_cells())
              + " | rps (100-token prompts, 32 clients) |",
              "|---|" + "---|" * (len(overhead_cells()) + 1)]
        for name, r in ov["targets"].items():
            L.append(f"| {name} | " + " | ".join(f"{r[k]['p50_ms']:.3f} / {r[k]['p99_ms']:.3f}" for k, _, _ in overhead_cells())
                     + f" | {r['saturate']['rps']:.0f} |")
        if "envoy+kvroute" in ov["targets"]:
            a, b = ov["targets"]["envoy+kvroute"], ov["targets"]["envoy"]
            L.append("| kvroute adds | " + " | ".join(
                f"{a[k]['p50_ms'] - b[k]['p50_ms']:+.3f} / {a[k]['p99_ms'] - b[k]['p99_ms']:+.3f}"
                for k, _, _ in overhead_cells()) + " | |")
        if "envoy+extproc" in ov["targets"]:
            a, b = ov["targets"]["envoy+extproc"], ov["targets"]["envoy"]
            L.append("| ext_proc floor adds | " + " | ".join(
                f"{a[k]['p50_ms'] - b[k]['p50_ms']:+.3f} / {a[k]['p99_ms'] - b[k]['p99_ms']:+.3f}"
                for k, _, _ in overhead_cells()) + " | |")
        L += extproc_ratio_markdown(ov)
        for what in ("kvroute", "extproc"):
            if ov.get(f"{what}_error"):
                L.append(f"\n{what} could not run here: {ov[f'{what}_error']}")
    return L


def extproc_ratio_markdown(ov):
    """kvroute against the ext_proc floor, per prompt size: the p50 each adds to Envoy alone
    (warm prompts), the Envoy CPU per request of each path and the picker's own, and the
    ratios (floor / kvroute)."""
    t, cpu = ov["targets"], ov.get("cpu_ms_per_request") or {}
    if "envoy+extproc" not in t or "envoy+kvroute" not in t:
        return []
    L = ["", "kvroute in Envoy against the ext_proc floor (Envoy's ext_proc filter, BUFFERED body, calling a "
         "minimal gRPC endpoint picker on this machine: relay/examples/extproc_picker.rs), warm prompts; "
         "CPU is user+system of each process over the run, per request:", "",
         "| prompt | kvroute adds p50 ms | floor adds p50 ms | latency ratio | Envoy CPU ms/req: alone / kvroute / "
         "ext_proc + picker | CPU ratio (floor / kvroute) |", "|---|---|---|---|---|---|"]
    for n in OVERHEAD_SIZES:
        k = f"warm{n}"
        if k not in t["envoy"]:
            continue
        kv = t["envoy+kvroute"][k]["p50_ms"] - t["envoy"][k]["p50_ms"]
        ep = t["envoy+extproc"][k]["p50_ms"] - t["envoy"][k]["p50_ms"]
        c = {name: (cpu.get(name) or {}).get(str(n)) for name in ("envoy", "envoy+kvroute", "envoy+extproc",
                                                                   "extproc picker")}
        floor = None if c["envoy+extproc"] is None else c["envoy+extproc"] + (c["extproc picker"] or 0.0)
        lat_ratio = f"{ep / kv:.1f}x" if kv > 0 else "-"
        cpu_ratio = f"{floor / c['envoy+kvroute']:.1f}x" if floor and c["envoy+kvroute"] else "-"
        L.append(f"| {n // 1000}k | {kv:+.3f} | {ep:+.3f} | {lat_ratio} | {fmt(c['envoy'])} / "
                 f"{fmt(c['envoy+kvroute'])} / {fmt(c['envoy+extproc'])} + {fmt(c['extproc picker'])} | {cpu_ratio} |")
    return L
