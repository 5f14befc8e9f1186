"""One cell: a (scenario, policy, load, repeat) run on a fresh fleet. It starts the workers, the
router under test (one gateway or N behind a front) and loadgen with the scenario's workload,
reads every counter when loadgen is done, stops everything it started and returns loadgen's
summary with those counters added (one entry of results.json's `runs`)."""

import json
import math
import os
import shutil
import subprocess
import time

import envoyconf

from kvbench import log, paths, peers
from kvbench.config import cell_cfg
from kvbench.metrics import envoy_kvroute_stats, ladder_stats, prom, scrape, sharing_stats
from kvbench.policies import EVENT_POLICIES, POLICY, TOKENIZE_MAX_FAILED, oracle_label, parse_label
from kvbench.procs import Procs, http, proc_cpu_s
from kvbench.stack import (check_routes, decode_workers, start_envoy, start_fleet, start_front, start_nats,
                           start_relay, start_resets, wait_stream_live)
from kvbench.stats import fmt, merged, precise_text, sharing_text, stat


def start_bypass(cfg, ws, speed, cell):
    """The `bypass` client: loadgen with the scenario's workload on another seed, `bypass` x
    its sessions and rate, sent past the router: to the first decode worker (`bypass_target`
    one) or round-robin over all of them through a plain Envoy (all, as a Kubernetes Service
    would). Returns (its loadgen or None when off, the processes it needs beside it)."""
    share = cfg.get("bypass")
    if not share or cfg["workload"] != "synthetic":
        return None, []
    args = workload_args(cfg, speed)
    corpus, target = cfg.get("bypass_corpus", "own"), cfg.get("bypass_target", "one")
    if corpus not in ("own", "same"):
        raise ValueError(f"bypass_corpus {corpus!r}: own or same")
    if target not in ("one", "all"):
        raise ValueError(f"bypass_target {target!r}: one or all")
    if corpus == "same":
        args += ["--corpus-seed", str(cfg["seed"])]
    for flag, f in (("--seed", lambda v: str(int(v) + 1000)), ("--sessions", lambda v: str(max(1, round(int(v) * share)))),
                    ("--rate", lambda v: f"{float(v) * share:g}")):
        if flag in args:
            i = args.index(flag) + 1
            args[i] = f(args[i])
    out = os.path.join(cell, "bypass")
    os.makedirs(out, exist_ok=True)
    side, url = [], decode_workers(ws)[0]["url"]
    if target == "all":
        p, url = start_front(cfg, [w["url"] for w in decode_workers(ws)], out)
        side.append(p)
    lg = [paths.LOADGEN] + args + ["--max-output", str(cfg["max_output"]), "--sim-speedup", str(cfg["speedup"]),
                                   "--model", paths.MODEL, "--fleet-size", "1", "--warmup", "0", "--label", "bypass",
                                   "--out", out, "--timeout-s", "300", "--target", url]
    return subprocess.Popen(lg, stdout=open(os.path.join(out, "loadgen.log"), "wb"), stderr=subprocess.STDOUT), side


def check_precise(policy, p):
    """Raises when a kvroute-tokenize / kvroute-precise cell did not run as intended: the relay
    stream never went live, or more than TOKENIZE_MAX_FAILED of the tokenize calls failed."""
    st = p["envoy"]
    bad = []
    if policy in EVENT_POLICIES and not p.get("stream_live_seen"):
        bad.append("kvroute_precise_stream_live never reached 1")
    # Tokenize calls run beside the request (issue 42): a failed one delays nothing, it only
    # leaves that prompt's text unmapped to engine blocks; reported, not fatal.
    ok, failed = p["tokenize_ok"], p["tokenize_failed"]
    if policy in EVENT_POLICIES and ok == 0:
        bad.append("no tokenize call answered (kvroute_tokenize_ok_total is 0)")
    elif ok + failed and p["tokenize_failed_share"] > TOKENIZE_MAX_FAILED:
        print(f"[bench] {policy}: tokenize failed {failed:g} of {ok + failed:g} calls "
              f"({p['tokenize_failed_share']:.1%})", flush=True)
    if policy in EVENT_POLICIES and stat(st, "kvroute_precise_blocks_stored_total") == 0:
        bad.append("the filter applied no engine BlockStored events (kvroute_precise_blocks_stored_total 0)")
    if bad:
        raise RuntimeError(f"{policy}: " + "; ".join(bad))


def workload_args(cfg, load):
    """loadgen's workload flags for one offered load of the configured scenario."""
    if cfg["workload"] == "mooncake":
        return ["--trace", paths.trace_path(cfg), "--start", str(cfg["start"]), "--count", str(cfg["count"]),
                "--speed", str(load), "--block-tokens", str(cfg["block_tokens"]),
                "--max-input-tokens", str(cfg["max_input_tokens"])] + (
                    ["--burst", str(cfg["burst"])] if cfg.get("burst") else [])
    # Synthetic: load is new sessions per simulated second and think_s simulated seconds;
    # loadgen's --rate and --think-ms are wall-clock, so the rate is multiplied by the fleet's
    # speedup and the think time divided by it.
    return ["--workload", "synthetic", "--seed", str(cfg["seed"]), "--sessions", str(sessions_at(cfg, load)),
            "--turns", f"{cfg['turns'][0]}-{cfg['turns'][1]}", "--rate", f"{load * cfg['speedup']:g}",
            "--think-ms", f"{cfg['think_s'] * 1000 / cfg['speedup']:g}", "--speed", "1"] + list(cfg["loadgen_args"])


def sessions_at(cfg, load):
    """Sessions one synthetic run sends at `load`: the scenario's count, or more above its
    sweep (`window_s`), so that sessions keep arriving for window_s simulated seconds. With a
    fixed count a load past count / window_s only sends the same sessions sooner, until the
    run is one burst of all of them and no higher load adds any: the goodput search could not
    tell a router that holds the load from one that merely drains that burst in time."""
    return max(cfg["sessions"], math.ceil(load * cfg.get("window_s", 0) - 1e-9))


# The routers that are an Envoy of ours (stack.start_envoy); the others are peers.start's.
ENVOY_ROUTERS = ("kvroute", "envoy", "steer")


def start_router(cfg, policy, ws, logdir, extra=None, relay_port=None):
    """The router under test in front of ws: Envoy (kvroute with `extra` plugin settings and
    kvroute-relay's gRPC port, a built-in lb_policy, the steer diagnostics) or a peer router.
    Returns (processes, URL, Envoy admin URL or None, CPU parts as peers.start names them)."""
    if POLICY[policy].router in ENVOY_ROUTERS:
        p, url, admin = start_envoy(cfg, policy, ws, logdir, extra, relay_port)
        return [p], url, admin, {}
    ps, url, parts = peers.start(cfg, policy, ws, logdir)
    return ps, url, None, parts


def run_cell(cfg, policy, speed, rawdir, rep=0, oracle=None):
    """One run: fresh fleet, router, loadgen; returns loadgen's summary plus the workers'
    counters. rep > 0: a repeat of the same point (its own folder); oracle: the oracle's
    (prefill_scale, held_weight) for this run."""
    if oracle is not None:
        cfg = dict(cfg, oracle_prefill_scale=oracle[0], oracle_held_weight=oracle[1])
    sub = oracle_label(oracle) if oracle is not None else policy  # the label (`kvroute@4`)
    cell = os.path.join(rawdir, sub, f"load{speed:g}" + (f"_r{rep}" if rep else ""))
    shutil.rmtree(cell, ignore_errors=True)
    os.makedirs(cell)
    started = list(Procs.live)
    t_cell = time.time()
    label = policy
    policy, n_gw = parse_label(label)
    cfg = cell_cfg(cfg, policy)
    if n_gw == 1 and policy.endswith("-noshare"):
        policy = policy[:-len("-noshare")]  # one gateway: nothing to share
    pol = POLICY[policy]
    events = pol.router == "kvroute" and pol.events  # its relays subscribe to the workers' KV events
    share = n_gw > 1 and pol.shares
    use_relay = events or share
    admins, relay_urls = [], []
    precise = None
    sharing = None
    try:
        ws = start_fleet(cfg, cell, kv_events=pol.events)
        procs = [w["proc"] for w in ws]
        cpu_parts = {}  # issue 43's peers: the router proper and our glue, measured apart
        nats = None
        if share:
            np_, nats = start_nats(cell)
            procs.append(np_)
        lg = [paths.LOADGEN] + workload_args(cfg, speed) + [
              "--max-output", str(cfg["max_output"]),
              "--sim-speedup", str(cfg["speedup"]), "--model", paths.MODEL, "--fleet-size", str(len(decode_workers(ws))),
              "--warmup", str(cfg["warmup"]), "--label", label, "--out", cell, "--timeout-s", "300",
              "--stream-usage", "on" if cfg.get("stream_usage", True) else "off"]
        if policy == "oracle":
            lg += ["--oracle-workers", ",".join(w["url"] for w in decode_workers(ws)),
                   "--oracle-prefill-scale", str(cfg["oracle_prefill_scale"]),
                   "--oracle-held-weight", str(cfg["oracle_held_weight"])]
        else:
            urls, relays = [], []
            for i in range(n_gw):
                gdir = cell if n_gw == 1 else os.path.join(cell, f"gw{i}")
                os.makedirs(gdir, exist_ok=True)
                extra, relay_port = None, None
                if pol.router in ENVOY_ROUTERS:
                    extra = cfg["tuned"] if pol.tuned else pol.plugin
                    if use_relay:
                        rp, relay_port, rm = start_relay(cfg, ws if events else [], gdir, nats)
                        procs.append(rp)
                        relays.append(rp)
                        relay_urls.append(rm)
                    if n_gw > 1 and use_relay:
                        # The relay key (the precise one is its alias) with the sharing switch.
                        extra = {k: v for k, v in (extra or {}).items() if k != "precise"}
                        extra["relay"] = {"cluster": envoyconf.RELAY_CLUSTER, "share_decisions": share}
                ps, url, admin, cpu_parts = start_router(cfg, policy, ws, gdir, extra, relay_port)
                procs += ps
                admins += [admin] if admin else []
                check_routes(url, procs, policy, admins[-1:] if pol.router == "kvroute" else ())
                urls.append(url)
            if relays:
                cpu_parts["relay"] = relays  # part of the router's CPU, shown apart too
            url = urls[0]
            if n_gw > 1:
                p, url = start_front(cfg, urls, cell)
                procs.append(p)
                check_routes(url, procs, policy, admins if pol.router == "kvroute" else ())
            lg += ["--target", url]
        if pol.plugin is not None:
            precise = {"stream_live_seen": False}
        if use_relay:
            # Loud failure (the cell is not run) when a gateway's stream does not come up.
            for admin in admins:
                wait_stream_live(admin, procs)
            if precise is not None:
                precise["stream_live_seen"] = True
                precise["stream_live_at_start"] = min(stat(envoy_kvroute_stats(a), "kvroute_precise_stream_live")
                                                      for a in admins)
        live = []
        # CPU the router under test (Envoy, a peer router, the replicas' front) and the fleet
        # spend during the workload: on this 2-core machine it is taken from the others.
        fleet_procs = [w["proc"] for w in ws]
        router_procs = [p for p in procs if all(p is not w for w in fleet_procs)]
        cpu0 = (proc_cpu_s(router_procs), proc_cpu_s(fleet_procs))
        parts0 = {k: proc_cpu_s(v) for k, v in cpu_parts.items()}
        reset_timer, resets = start_resets(cfg, ws)
        bypass, side = start_bypass(cfg, ws, speed, cell)
        procs += side + ([bypass] if bypass is not None else [])
        with open(os.path.join(cell, "loadgen.log"), "wb") as f:
            if use_relay:
                # The streams' liveness sampled through the run, the least live gateway's (a
                # drop would show as min 0).
                lgp = subprocess.Popen(lg, stdout=f, stderr=subprocess.STDOUT)
                while lgp.poll() is None:
                    try:
                        live.append(min(stat(envoy_kvroute_stats(a), "kvroute_precise_stream_live") for a in admins))
                    except Exception:
                        pass
                    time.sleep(1.0)
                rc = lgp.wait()
                if precise is not None:
                    precise["stream_live_samples"] = len(live)
                    precise["stream_live_min"] = min(live) if live else None
                    precise["stream_live_max"] = max(live) if live else None
            else:
                rc = subprocess.run(lg, stdout=f, stderr=subprocess.STDOUT).returncode
        if reset_timer is not None:
            reset_timer.cancel()
        if bypass is not None:
            bypass.wait(timeout=120)
        cpu1 = (proc_cpu_s(router_procs), proc_cpu_s(fleet_procs))
        parts1 = {k: proc_cpu_s(v) for k, v in cpu_parts.items()}
        for i, a in enumerate(admins):
            # Every Envoy stat at the end of the run (kvroute's route time, replication,
            # fallbacks...), for whoever reads the raw folder.
            st, _, body = http("GET", a + "/stats")
            if st == 200:
                with open(os.path.join(cell, f"envoy-stats{i if i else ''}.txt"), "wb") as f:
                    f.write(body)
        if rc != 0:
            raise RuntimeError(f"loadgen exited {rc} (see {cell}/loadgen.log)")
        with open(os.path.join(cell, "summary.json")) as f:
            s = json.load(f)
        if policy != "oracle":
            s["router_cpu_s"] = round(cpu1[0] - cpu0[0], 3)
            s["router_cpu_ms_per_request"] = round(1e3 * s["router_cpu_s"] / max(1, s["requests"]), 3)
            if cpu_parts:
                s["cpu_parts_ms_per_request"] = {k: round(1e3 * (parts1[k] - parts0[k]) / max(1, s["requests"]), 3)
                                                 for k in cpu_parts}
            if "glue" in cpu_parts and n_gw == 1:
                s["glue"] = peers.glue_stats(url)
        s["fleet_cpu_s"] = round(cpu1[1] - cpu0[1], 3)
        if resets:
            s["resets"] = resets
        if precise is not None:
            # What the filter did with tokenization and the relay stream, and (precise) the
            # relay's own counters, at the end of the run; written before any check fails.
            per_gw = [envoy_kvroute_stats(a) for a in admins]
            precise["envoy"] = st = merged(per_gw)
            if relay_urls:
                precise["relay"] = merged(prom(u + "/metrics", ("kvroute_relay_",)) for u in relay_urls)
            precise["stream_live_end"] = min(stat(x, "kvroute_precise_stream_live") for x in per_gw)
            precise["stream_live_seen"] = precise["stream_live_seen"] or precise["stream_live_end"] >= 1
            precise["tokenize_ok"] = ok = stat(st, "kvroute_tokenize_ok_total")
            precise["tokenize_failed"] = failed = stat(st, "kvroute_tokenize_failed_total")
            precise["tokenize_failed_share"] = failed / (ok + failed) if ok + failed else None
            for k in ("blocks_stored_total", "blocks_removed_total", "updates_total", "stream_failures_total",
                      "unknown_workers_total"):
                precise["filter_" + k] = stat(st, "kvroute_precise_" + k)
            s["precise"] = precise
            with open(os.path.join(cell, "precise.json"), "w") as f:
                json.dump(precise, f, indent=1)
            check_precise(policy, precise)
        if n_gw > 1 and admins:
            # Decision sharing between the gateways (issue 15): the filters' kvroute_peers_*
            # (Envoy stats, per gateway and summed) and the relays' sharing metrics.
            sharing = sharing_stats(admins, relay_urls, share)
            sharing["stream_live_min"] = min(live) if live else None
            s["sharing"] = sharing
            with open(os.path.join(cell, "sharing.json"), "w") as f:
                json.dump(sharing, f, indent=1)
            if share and not sharing["peers_received"]:
                raise RuntimeError(f"{label}: sharing on but no gateway received a peer's decision "
                                   "(kvroute_peers_received_total 0)")
        s["gateways"] = n_gw
        s["policy"] = policy
        s["worker_metrics"] = m = scrape(ws)
        if admins and pol.router == "kvroute":
            s["ladder"] = ladder_stats(admins, m)
        # Engine-side hit rate (all requests, warm-up included): what the workers' prefix
        # caches served, whether or not they report cached_tokens to clients.
        q = m.get("vllm:prefix_cache_queries_total")
        s["engine_hit_rate"] = m.get("vllm:prefix_cache_hits_total", 0.0) / q if q else None
        s["preemptions"] = m.get("vllm:num_preemptions_total")
        s["evicted_blocks"] = m.get("mock:kv_evicted_blocks_total")
        s["adapter_loads"] = m.get("mock:lora_loads_total")
        if s.get("cached_tokens", 0) == 0 and s["engine_hit_rate"]:
            # Workers without --enable-prompt-tokens-details (vLLM's default) report no
            # cached_tokens: the engine's own count stands in.
            s["client_hit_rate"], s["hit_rate"] = s["hit_rate"], s["engine_hit_rate"]
            s["hit_rate_source"] = "engine"
        else:
            s["hit_rate_source"] = "usage"
        s["wall_s"] = time.time() - t_cell
        s["load"] = speed
        s["repeat"] = rep
        if oracle is not None:
            s["oracle_setting"] = oracle_label(oracle)
        log(f"{cfg['scenario']:>14s} {label if oracle is None else sub:24s} {cfg['load_name']} {speed:>5g}{f' r{rep}' if rep else ''}: "
            f"{s['ok']}/{s['requests']} ok, offered {s['offered_rps_sim']:.2f} rps(sim), "
            f"TTFT p50 {fmt(s['ttft_sim_s']['p50'])} p90 {fmt(s['ttft_sim_s']['p90'])} s, "
            f"TPOT p90 {fmt((s.get('tpot_sim_s') or {}).get('p90'), 4)} s, hit {s['hit_rate']:.3f} "
            f"(ceiling {fmt(s.get('reuse_ceiling_all'))}), max/mean {s['max_over_mean_requests']:.2f}, "
            f"preempt {s['preemptions']}, evicted {s['evicted_blocks']}, "
            + (f"adapter loads {int(s['adapter_loads'])}, " if s.get("adapter_loads") is not None else "")
            + (f"handed off {s['handed_off']}/{s.get('ok', '?')}, " if s.get("handed_off") else "")
            + (f"router CPU {s['router_cpu_ms_per_request']:.2f} ms/request"
               + "".join(f" ({k} {v:.2f})" for k, v in s.get("cpu_parts_ms_per_request", {}).items())
               + ", " if "router_cpu_s" in s else "")
            + (f"glue pick p50/p90 {s['glue']['pick_ms'].get('p50')}/{s['glue']['pick_ms'].get('p90')} ms wall "
               f"(tokenize {s['glue']['tokenize_ms'].get('p50')}/{s['glue']['tokenize_ms'].get('p90')}), "
               if (s.get("glue") or {}).get("pick_ms") else "")
            + f"{s['wall_s']:.0f} s wall"
            + ("" if precise is None else " | " + precise_text(precise))
            + ("" if sharing is None else " | " + sharing_text(sharing)))
        return s
    finally:
        Procs.stop([p for p in Procs.live if p not in started])
