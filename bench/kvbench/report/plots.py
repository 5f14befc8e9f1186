"""The PNGs beside results.md (bench/README.md lists them), from results.json and, for the TTFT
distribution, the raw per-request records where they are still on disk. matplotlib comes from
build/bench-venv; without it there are no plots and the rest of the report stands."""

import json
import os

from kvbench import log
from kvbench.config import overhead_cells
from kvbench.goodput import gp_text, p90
from kvbench.policies import parse_label


def save(fig, path):
    """Writes one figure at the report's resolution and frees it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(cfg, res, outdir, rawdir, prefix=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {p: r for p, r in res["policies"].items() if "error" not in r}
    main = f"{cfg['main_speed']:g}"
    # TTFT CDF at the main point, from the per-request records.
    fig, ax = plt.subplots(figsize=(8, 5))
    for pol in ok:
        f = os.path.join(rawdir, pol, f"load{main}", "requests.jsonl")
        if not os.path.exists(f):
            continue
        v = []
        with open(f) as fh:
            for line in fh:
                r = json.loads(line)
                if r["i"] >= cfg["warmup"] and r["error"] is None and r["ttft"] is not None:
                    v.append(r["ttft"] * cfg["speedup"])
        v.sort()
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=pol,
                    lw=2.2 if pol.startswith("kvroute") or pol == "oracle" else 1.3)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (simulated s, log)")
    ax.set_ylabel("fraction of requests")
    ax.axvline(cfg["slo_s"], color="grey", ls=":", lw=1)
    ax.set_title(f"TTFT CDF, {cfg['scenario']} ({cfg['split']}), {cfg['load_name']} {main}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, os.path.join(outdir, prefix + "ttft_cdf.png"))

    # Hit rate per policy.
    pols = [p for p in ok if main in ok[p]["runs"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    hr = [ok[p]["runs"][main]["hit_rate"] for p in pols]
    bars = ax.bar(range(len(pols)), hr, color=["C3" if p.startswith("kvroute") else "C2" if p == "oracle" else "C0" for p in pols])
    for b, h in zip(bars, hr):
        ax.text(b.get_x() + b.get_width() / 2, h, f"{h:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(pols)), pols, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prompt-cache hit rate (cached / prompt tokens)")
    ax.set_title(f"Hit rate per policy, {cfg['scenario']}, {cfg['load_name']} {main}")
    save(fig, os.path.join(outdir, prefix + "hit_rate.png"))

    # Requests per worker (heat map).
    names = [f"w{i}" for i in range(cfg["workers"])]
    grid = [[ok[p]["runs"][main]["per_worker"].get(n, {}).get("requests", 0) for n in names] for p in pols]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(pols) + 1.5))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color="white" if v < max(map(max, grid)) * 0.6 else "black")
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks(range(len(pols)), [f"{p} ({ok[p]['runs'][main]['max_over_mean_requests']:.2f})" for p in pols], fontsize=8)
    ax.set_title(f"Requests per worker, {cfg['scenario']}, {cfg['load_name']} {main} (max/mean in brackets)")
    fig.colorbar(im, ax=ax)
    save(fig, os.path.join(outdir, prefix + "requests_per_worker.png"))

    # p90 TTFT against offered rate: every run of the sweep and the bisection.
    fig, ax = plt.subplots(figsize=(8, 5))
    for pol, r in ok.items():
        pts = sorted(r["runs"].values(), key=lambda s: s["offered_rps_sim"])
        xs = [s["offered_rps_sim"] for s in pts if s["ttft_sim_s"]["p90"] is not None]
        ys = [s["ttft_sim_s"]["p90"] for s in pts if s["ttft_sim_s"]["p90"] is not None]
        ax.plot(xs, ys, marker="o", label=f"{pol} (goodput {gp_text((r.get('goodput') or {}).get(cfg_slo(cfg)))})",
                lw=2.2 if pol.startswith("kvroute") or pol == "oracle" else 1.3)
    for slo in cfg["slos"]:
        ax.axhline(slo, color="grey", ls=":", lw=1)
        ax.text(ax.get_xlim()[0], slo, f" SLO {slo:g} s", va="bottom", fontsize=7, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("offered request rate (simulated req/s)")
    ax.set_ylabel("TTFT p90 (simulated s, log)")
    ax.set_title(f"TTFT p90 vs. request rate, {cfg['scenario']} (sweep and bisection runs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    save(fig, os.path.join(outdir, prefix + "p90_ttft.png"))

    # Goodput against the TTFT SLO, one line per policy; hollow markers: not bisected (read off
    # the sweep); ^: a lower bound (met up to the cap); v at 0: missed even at the floor.
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (pol, r) in enumerate(ok.items()):
        gs = [(g["slo"], g) for g in (r.get("goodput") or {}).values() if g]
        if not gs:
            continue
        gs.sort(key=lambda t: t[0])
        col = f"C{i % 10}"
        xs = [x for x, _ in gs]
        ys = [g["value"] for _, g in gs]
        ax.plot(xs, ys, color=col, lw=2.2 if pol.startswith("kvroute") or pol == "oracle" else 1.3, label=pol)
        for x, g in gs:
            mk = "^" if g["kind"] == ">=" else "v" if g["kind"] == "<" else "o"
            ax.plot([x], [g["value"]], marker=mk, color=col, mfc=col if g["method"] == "bisect" else "none", ms=7)
            if g.get("per_repeat") and len(set(g["per_repeat"])) > 1:
                ax.vlines(x, min(g["per_repeat"]), max(g["per_repeat"]), color=col, lw=4, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg["slos"], [f"{x:g}" for x in cfg["slos"]])
    ax.set_xlabel(f"TTFT p90 SLO (simulated s; every SLO also needs p90 TPOT <= {cfg['tpot_slo_s']:g} s)")
    ax.set_ylabel(f"goodput ({cfg['load_name']}: offered load knob)")
    ax.set_title(f"Goodput vs. SLO, {cfg['scenario']} ({cfg['split']}); filled: bisected, hollow: from the sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, os.path.join(outdir, prefix + "goodput.png"))


def cfg_slo(cfg):
    return f"{cfg['slo_s']:g}"


def plot_replicas(cfg, res, outdir, prefix=""):
    """Gateway replicas: hit rate and p90 TTFT at each load, and goodput at the main SLO,
    against the number of gateways, one line per policy (the -noshare lines start from their
    policy's one-gateway cell)."""
    P = res["policies"]
    if not any("@" in p for p in P):
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = {}
    for pol, r in P.items():
        base, n = parse_label(pol)
        if r.get("runs"):
            lines.setdefault(base, {})[n] = r
    for base in list(lines):
        if base.endswith("-noshare") and base[:-len("-noshare")] in lines and 1 in lines[base[:-len("-noshare")]]:
            lines[base].setdefault(1, lines[base[:-len("-noshare")]][1])
    speeds = sorted(cfg["speeds"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    slo = f"{cfg['slo_s']:g}"
    for j, (base, by_n) in enumerate(sorted(lines.items())):
        ns = sorted(by_n)
        col, ls = f"C{j}", "--" if base.endswith("-noshare") else "-"
        for k, sp in enumerate(speeds):
            key = f"{sp:g}"
            pts = [(n, by_n[n]["runs"][key]) for n in ns if key in by_n[n]["runs"]]
            mk = "o" if k == 0 else "s"
            lab = f"{base} ({cfg['load_name']} {sp:g})"
            axes[0].plot([n for n, _ in pts], [x["hit_rate"] for _, x in pts], ls=ls, marker=mk, color=col,
                         alpha=1.0 if k else 0.6, label=lab)
            axes[1].plot([n for n, _ in pts], [p90(x, "ttft_sim_s") for _, x in pts], ls=ls, marker=mk, color=col,
                         alpha=1.0 if k else 0.6, label=lab)
        gs = [(n, (by_n[n].get("goodput") or {}).get(slo)) for n in ns]
        gs = [(n, g["value"]) for n, g in gs if g]
        axes[2].plot([n for n, _ in gs], [v for _, v in gs], ls=ls, marker="o", color=col, label=base)
    axes[0].set_ylabel("hit rate (cached / prompt tokens)")
    axes[1].set_ylabel("p90 TTFT, simulated s")
    axes[1].axhline(cfg["slo_s"], color="grey", ls=":", lw=1)
    axes[2].set_ylabel(f"goodput @ p90 TTFT <= {slo} s ({cfg['load_name']})")
    for ax in axes:
        ax.set_xlabel("gateways")
        ax.set_xticks(sorted({parse_label(p)[1] for p in P}))
    axes[0].legend(fontsize=6)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{cfg['scenario']}: gateway replicas (circles: first load, squares: second; dashed: sharing off)")
    save(fig, os.path.join(outdir, prefix + "replicas.png"))


def plot_overhead(res, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ov = res.get("overhead")
    if ov and ov.get("targets"):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        names = list(ov["targets"])
        wdt = 0.8 / len(names)
        for k, name in enumerate(names):
            r = ov["targets"][name]
            cells = overhead_cells()
            xs = [i + k * wdt for i in range(len(cells))]
            ax.bar(xs, [r[key]["p50_ms"] for key, _, _ in cells], wdt, label=f"{name} p50")
            ax.scatter(xs, [r[key]["p99_ms"] for key, _, _ in cells], marker="_", s=200, color="black")
        ax.set_xticks([i + 0.4 - wdt / 2 for i in range(len(cells))], [f"{n // 1000}k {kind}" for _, kind, n in cells],
                      fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("request latency, wall ms (bar p50, tick p99)")
        ax.set_title("Proxy overhead, one instant worker")
        ax.legend(fontsize=8)
        save(fig, os.path.join(outdir, "overhead.png"))


def write_plots(res, outdir):
    rawdir = os.path.join(outdir, "raw")
    try:
        for n, sres in res["scenarios"].items():
            if sres["policies"]:
                plot(sres["config"], sres, outdir, os.path.join(rawdir, n), prefix=f"{n}_")
                plot_replicas(sres["config"], sres, outdir, prefix=f"{n}_")
        plot_overhead(res, outdir)
    except ImportError as e:
        log(f"no plots: {e} (run with build/bench-venv/bin/python)")
