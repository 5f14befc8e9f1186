"""The presets, one scenario's configuration (preset, then bench/scenarios.py, then the command
line), the fleet's shape (prefill pools, mock-worker flags) and the overhead step's cells. Pure:
the report reads the same functions back from a results.json's config."""

import scenarios

# Fleet and workload. The fleet runs the Dynamo mocker timing model; --speedup compresses
# simulated time, and every latency is reported in simulated seconds (wall x speedup).
# Capacity comes from a mock-worker --preset named after a real deployment (llama3-8b-h100:
# Llama-3.1-8B on one H100 80GB, 26,624 blocks of 16 tokens, vLLM's max-num-seqs 1024 and
# max-batched-tokens 8192), so eviction and preemption happen as they would; kv_blocks,
# block_size, max_num_seqs, max_batched_tokens override it when set. mock_flags are extra
# mock-worker flags, e.g. "--enable-prompt-tokens-details" (real vLLM's defaults otherwise).
# pool_workers: how many of the same `workers` the kvroute-pool policy starts as its prefill
# pool (`--role prefill`, handing the KV to the decode worker kvroute names; disaggregation at
# its defaults); None: a quarter of the fleet, at least 1 (2 of 8, the split the pool runs of
# bench/results/*-pool measured). Every other policy, kvroute included, routes over all of them.
# prefill_workers (legacy, only when set): the last M workers are a pool for every cell, kvroute
# runs with it and every other policy routes to the decode workers only, so kvroute has M more
# workers than its peers and its targets are not judged (bench/README.md, Prefill pool).
COMMON = dict(
    workers=8,
    pool_workers=None,
    prefill_workers=0,
    speedup=4.0,
    mock_preset="llama3-8b-h100",
    kv_blocks=None,
    block_size=None,
    max_num_seqs=None,
    max_batched_tokens=None,
    mock_flags="",
    trace="conversation_trace.jsonl",
    block_tokens=512,  # trace blocks replayed at full size (smaller values scale prompts down)
    max_output=64,
    max_input_tokens=32000,
    # Mooncake replays: "AT:LEN:F" replays that part of the slice's trace time (fractions of
    # its span) F x faster (loadgen --burst); None replays it as recorded.
    burst=None,
    slo_s=2.0,  # the main TTFT SLO (plots, the sweep table)
    # Goodput (bench/README.md): TTFT SLOs, the TPOT SLO every one of them also requires, the
    # bisection's tolerance on the load knob, how far it brackets upward (x the highest load of
    # the sweep) and downward (x the lowest), probes per SLO at most.
    slos=[0.5, 1.0, 2.0, 4.0],
    tpot_slo_s=0.1,
    goodput_tol=0.03,
    goodput_cap=2.0,
    goodput_floor=0.5,
    goodput_max_probes=6,
    # The SLOs the bisection runs at (the others are read off the sweep): the 2 s headline only
    # by default, which keeps make bench within 40 min on 2 cores (bench/README.md);
    # --bisect-slos all for every SLO.
    bisect_slos=[2.0],
    # auto also bisects kvroute and the best peer at any other SLO where the sweep cannot
    # decide the comparison: their read-off goodputs within this factor of each other (a
    # miss at the lowest load counting as that load), or both missing the SLO at the lowest
    # load (0: off). Clear wins and losses, and both meeting the SLO up to the cap, stay read
    # off the sweep.
    bisect_close=0.15,
    # ...except where both missed it at the lowest load by this factor or more (p90 TTFT or
    # TPOT over its SLO): near idle the p90 is the service time of the longest prompts, which
    # halving the load does not shorten (conversation at 0.5 s: p90 0.98 and 1.02 s at speed
    # 12, 0.95-0.98 at 6), so the floor probe (the slowest runs of make bench, 2 x 2 x 39 s
    # there) could only confirm "undecided".
    bisect_close_floor_ratio=1.5,
    # auto also bisects round-robin at 2 s where the 3x target needs it (off by default: time).
    bisect_rr=False,
    # Wall-clock budget of the whole run in minutes (None: none). The sweeps and the bisection
    # the targets need always run; the close calls' bisections (`bisect_close`) run only while
    # the scenario is within its share of what is left of the budget (scenarios.py
    # `expected_s`), so a slower machine or a run with many close calls reads more of them off
    # the sweep instead of running past it. Those skipped or cut are listed in results.
    budget_min=None,
    envoy_concurrency=2,
    # kvroute's debug headers (x-kvroute-costs and the rest): off, as in the shipped configs.
    kvroute_debug=False,
    # Each Envoy logs where every request's time went (envoyconf.TIMING_LOG_FORMAT) to its
    # envoy.log; with loadgen's path_in (requests.jsonl) it splits the way to the worker.
    envoy_timing_log=False,
    # loadgen asks for usage in every stream (prompt and cached tokens per request); false
    # sends streams as most clients do, without stream_options.include_usage (hit rate then
    # comes from the engines' own counters).
    stream_usage=True,
    # Issue 42, where predictions fail: `reset_at_s` wall seconds into the workload, POST
    # /reset_prefix_cache to the first half of the answering workers (an engine restart's or
    # an operator's cache reset, which no response tells the router). None: off.
    reset_at_s=None,
    # Issue 42: another client sends this share of the load (its own sessions, another seed)
    # straight to the workers (bypass_target), past the router. None: off. bypass_corpus:
    # "own" (its own system prompts and documents: it only evicts) or "same" (the gateway's
    # corpus: another application on the same documents, whose cache the router could use).
    bypass=None,
    bypass_corpus="own",
    # Where the bypass goes: "one" (the first decode worker) or "all" (round-robin over every
    # decode worker, as a Kubernetes Service in front of the pods would).
    bypass_target="one",
    # Issue 42: the workers' real KV capacity in blocks when it differs from the kv_blocks
    # kvroute is configured with (a wrong or stale setting). None: the same.
    engine_kv_blocks=None,
    # kvroute's metrics poller (plugin `metrics.poll_ms`, each worker scraped through a cluster
    # of its own): the engines' own queue and KV usage, whoever sent their load. None: off
    # (kvroute's own bookkeeping; the mock sends no ORCA report on streams, as vLLM).
    metrics_poll_ms=None,
    tuned={"scoring": {"prefill_load_scale": 8.0}},
    oracle_prefill_scale=1.0,
    oracle_held_weight=0.02,
    # The oracle is the best, load by load (lowest p90 TTFT), of these (prefill_scale,
    # held_weight) settings: its envelope.
    oracle_settings=[[1.0, 0.005], [1.0, 0.02], [1.0, 0.08]],
    # The dynamo-*-tuned policies' DYN_ROUTER_PREFILL_LOAD_SCALE (None: peers.TUNED_SCALE).
    dynamo_tuned_scale=None,
)


# quick: each scenario's first two loads (round-robin near half of its saturation and near it);
# full: all three. The workload, its seeds or trace slices and the loads come from
# bench/scenarios.py.
# goodput: bisect (full; quick with --goodput) or only read the sweep (quick); repeats: runs at
# each deciding load of the bisection (the first included); bisect: which policies are bisected
# (auto: kvroute, the best peer at each SLO, round-robin at the 2 s SLO where a target needs it).
PRESETS = {
    "quick": dict(COMMON, n_loads=2, overhead_requests=[200, 200, 50, 20], saturate_s=3.0,
                  goodput=False, repeats=1, bisect="auto"),
    "full": dict(COMMON, n_loads=3, overhead_requests=[1000, 1000, 300, 100], saturate_s=5.0,
                 goodput=True, repeats=2, bisect="auto", budget_min=37.0),
}

# The overhead step: prompt sizes (the presets' overhead_requests give the requests at each).
OVERHEAD_SIZES = [1000, 8000, 32000, 128000]
# warm: one document, a new question each request (the usual chat / RAG case); cold: a new
# prompt each request (every block is new to kvroute's index). Both with and without kvroute.
OVERHEAD_PROMPTS = ["warm", "cold"]


def overhead_cells():
    """The latency columns: (key in results.json, prompt kind, prompt tokens)."""
    return [(f"{kind}{n}", kind, n) for n in OVERHEAD_SIZES for kind in OVERHEAD_PROMPTS]


def mock_args(cfg, kv_blocks=None):
    """mock-worker flags for the fleet's capacity and behaviour."""
    argv = ["--preset", cfg["mock_preset"]]
    caps = dict(kv_blocks=kv_blocks or cfg.get("engine_kv_blocks") or cfg["kv_blocks"], block_size=cfg["block_size"],
                max_num_seqs=cfg["max_num_seqs"], max_batched_tokens=cfg["max_batched_tokens"])
    for k, v in caps.items():
        if v is not None:
            argv += ["--" + k.replace("_", "-"), str(v)]
    flags = cfg["mock_flags"]
    return argv + (flags.split() if isinstance(flags, str) else list(flags))


def prefill_pool(cfg):
    """Workers of the fleet that only prefill (`prefill_workers`), checked against its size."""
    m = int(cfg.get("prefill_workers") or 0)
    if m < 0 or m >= cfg["workers"]:
        raise ValueError(f"prefill_workers {m}: must be 0 to workers - 1 ({cfg['workers'] - 1})")
    return m


def pool_size(cfg):
    """kvroute-pool's prefill pool: `pool_workers` of the fleet (None: a quarter, at least 1)."""
    m = cfg.get("pool_workers")
    m = max(1, cfg["workers"] // 4) if m is None else int(m)
    if m < 1 or m >= cfg["workers"]:
        raise ValueError(f"pool_workers {m}: must be 1 to workers - 1 ({cfg['workers'] - 1})")
    return m


def cell_cfg(cfg, policy):
    """The config one policy's cells run with: kvroute-pool starts pool_size of the same workers
    as a prefill pool; the legacy prefill_workers (a pool for every cell) cannot be mixed in."""
    if policy != "kvroute-pool":
        return cfg
    if prefill_pool(cfg):
        raise ValueError("kvroute-pool with prefill_workers set: use one (pool_workers sizes kvroute-pool's pool)")
    return dict(cfg, prefill_workers=pool_size(cfg))


def fleet_split(cfg, policy):
    """(decode workers, prefill-pool workers) of a policy's cells (the peers and the oracle use
    the decode ones only)."""
    m = prefill_pool(cell_cfg(cfg, policy))
    return cfg["workers"] - m, m


def scenario_config(base, name, split, overrides):
    """One scenario's configuration: the preset, the scenario's settings and split, then the
    command line's overrides (--set etc. win over the scenario table)."""
    sc = scenarios.SCENARIOS[name]
    cfg = dict(base)
    cfg.update(sc["set"])
    cfg.update(scenario=name, split=split, workload=sc["workload"], description=sc["description"],
               load_name="speed" if sc["workload"] == "mooncake" else "rate")
    if sc["workload"] == "mooncake":
        cfg.update(start=sc[split]["start"], count=sc[split]["count"])
    else:
        cfg.update(seed=sc[split]["seed"], sessions=sc["sessions"], turns=list(sc["turns"]),
                   think_s=sc["think_s"], loadgen_args=list(sc["args"]))
    cfg["speeds"] = list(sc["loads"][:base["n_loads"]])
    cfg["main_speed"] = cfg["speeds"][min(1, len(cfg["speeds"]) - 1)]
    cfg.update(overrides)
    cfg["slos"] = sorted(set(cfg["slos"]) | {cfg["slo_s"]})
    if cfg["bisect_slos"] is None:
        cfg["bisect_slos"] = list(cfg["slos"])
    # The label follows overrides (--count, --set start=... / seed=...).
    cfg["split_label"] = (f"requests {cfg['start']}..{cfg['start'] + cfg['count'] - 1}" if sc["workload"] == "mooncake"
                          else f"seed {cfg['seed']}")
    if "speeds" in overrides and "main_speed" not in overrides and cfg["main_speed"] not in cfg["speeds"]:
        cfg["main_speed"] = cfg["speeds"][-1]
    if "warmup" not in overrides:
        n = cfg["count"] if cfg["workload"] == "mooncake" else scenarios.expected_requests(
            dict(sc, sessions=cfg["sessions"], turns=cfg["turns"]), split)
        cfg["warmup"] = round(0.1 * n)
    return cfg
