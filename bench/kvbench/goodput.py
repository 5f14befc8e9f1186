"""Goodput: the highest offered load at which a policy meets a TTFT SLO (p90), the TPOT SLO
(p90) and < 1 % errors. The SLO checks, the bracket and the interpolated crossing that read it
off a sweep, the bisection that narrows it (Runner, over whatever function runs a cell), and
which (policy, SLO) pairs are worth bisecting. Pure apart from the runs Runner asks for."""

import math

from kvbench.policies import PEERS, TARGET_3X_RR, oracle_label


def rnd(load):
    """Loads are kept to 3 significant digits: the cache key of a run (f"{load:g}")."""
    return float(f"{load:.3g}")


def p90(s, key):
    return (s.get(key) or {}).get("p90")


def slo_ratios(s, cfg, slo):
    """[p90 TTFT / TTFT SLO, p90 TPOT / TPOT SLO] (TPOT left out of summaries from before it
    was recorded): at most 1 each meets the SLO. None when 1 % or more of the requests failed
    or nothing was measured (a miss)."""
    if s["errors"] >= 0.01 * max(1, s["requests"]):
        return None
    t = p90(s, "ttft_sim_s")
    if t is None:
        return None
    tp = p90(s, "tpot_sim_s")
    return [t / slo] + ([tp / cfg["tpot_slo_s"]] if tp is not None else [])


def slo_metric(s, cfg, slo):
    """The larger of [`slo_ratios`]: at most 1 meets both; None is a miss."""
    r = slo_ratios(s, cfg, slo)
    return max(r) if r else None


def meets(s, cfg, slo):
    m = slo_metric(s, cfg, slo)
    return m is not None and m <= 1.0


def points_of(r):
    """A policy's first run at every load it ran, by load."""
    return {float(k): v for k, v in r.get("runs", {}).items()}


def bracket(pts, cfg, slo):
    """hi: the lowest load that misses the SLO; lo: the highest load below hi that meets it. A
    load above the first miss that happens to meet the SLO gets no credit."""
    ls = sorted(pts)
    miss = [x for x in ls if not meets(pts[x], cfg, slo)]
    hi = miss[0] if miss else None
    ok = [x for x in ls if (hi is None or x < hi) and meets(pts[x], cfg, slo)]
    return (ok[-1] if ok else None), hi


def crossing(pts, cfg, slo, lo, hi):
    """Where the SLO metric crosses 1 between lo and hi: each ratio's log interpolated linearly
    in the load on its own, the first to cross. (Interpolating their max would mix them: a
    TPOT-bound miss at hi read against a TTFT ratio at lo puts the crossing far too early
    when TPOT is still far below its SLO at lo.) None when the miss at hi is an error rate
    (no latency to interpolate)."""
    rl, rh = slo_ratios(pts[lo], cfg, slo), slo_ratios(pts[hi], cfg, slo)
    if not rl or not rh or len(rl) != len(rh):
        return None
    xs = [lo + (-math.log(ml)) / (math.log(mh) - math.log(ml)) * (hi - lo)
          for ml, mh in zip(rl, rh) if 0.0 < ml < mh and mh > 1.0]
    return min(xs) if xs else None


def goodput_result(r, cfg, slo, method):
    """Goodput of one policy at one TTFT SLO from the runs it has (pure: --report-only redoes
    it). kind '=': lo met the SLO and hi missed it; '>=': every load run met it (lo is the
    highest); '<': even the lowest load missed it. value: the load the targets compare (bisect:
    lo; sweep: the interpolated crossing when there is one). With repeats at the deciding loads,
    the spread of their p90 TTFTs and the goodput each repeat alone gives."""
    pts = points_of(r)
    if not pts:
        return None
    lo, hi = bracket(pts, cfg, slo)
    g = dict(slo=slo, method=method, lo=lo, hi=hi,
             kind="<" if lo is None else ">=" if hi is None else "=",
             lo_rps=pts[lo]["offered_rps_sim"] if lo is not None else None,
             hi_rps=pts[hi]["offered_rps_sim"] if hi is not None else None)
    g["interp"] = crossing(pts, cfg, slo, lo, hi) if g["kind"] == "=" else None
    g["resolved"] = g["kind"] == "=" and hi - lo <= cfg["goodput_tol"] * lo * 1.0001
    g["probes"] = r.get("probes", {}).get(f"{slo:g}")
    g["value"] = (0.0 if lo is None else g["interp"] if method == "sweep" and g["interp"] is not None else lo)
    reps = r.get("repeats", {})
    n = 1 + min([len(reps.get(f"{x:g}", [])) for x in (lo, hi) if x is not None], default=0)
    g["repeats"] = n
    if n > 1:
        def runs_at(x):
            return [pts[x]] + reps.get(f"{x:g}", [])[:n - 1]
        for tag, x in (("lo", lo), ("hi", hi)):
            if x is not None:
                v = [p90(s, "ttft_sim_s") for s in runs_at(x)]
                v = [y for y in v if y is not None]
                g[f"{tag}_p90_range"] = [min(v), max(v)] if v else None
                g[f"{tag}_meets"] = [meets(s, cfg, slo) for s in runs_at(x)]
        per = []
        for j in range(n):
            if hi is not None and g["hi_meets"][j]:
                per.append(hi)
            elif lo is not None and g["lo_meets"][j]:
                per.append(lo)
            else:
                per.append(0.0)
        g["per_repeat"] = per
    return g


def gp_text(g, digits=3):
    """One goodput cell: the load (its offered rps), the bracket or the bound, the repeats."""
    if g is None:
        return "-"
    if g["kind"] == "<":
        t = f"< {g['hi']:g}"
    elif g["kind"] == ">=":
        t = f">= {g['lo']:g} ({g['lo_rps']:.1f} rps)"
    elif g["method"] == "sweep":
        t = f"~{g['value']:.{digits}g} ({g['lo']:g}-{g['hi']:g})"
    else:
        t = (f"{g['lo']:g} ({g['lo_rps']:.1f} rps)" + ("" if g["resolved"] else f" [bracket {g['lo']:g}-{g['hi']:g}]"))
    if g["method"] == "sweep" and g["kind"] != "=":
        t += " (sweep)"
    if g.get("per_repeat") and len(set(g["per_repeat"])) > 1:
        t += " repeats " + per_repeat_text(g)
    return t


def per_repeat_text(g):
    """The goodput each repeat gives: a deciding load, or `<lo` when the repeat missed at lo
    (`<hi` when even the floor missed, so there is no lo)."""
    below = g["lo"] if g["lo"] is not None else g["hi"]
    return "/".join(f"{x:g}" if x else f"<{below:g}" for x in g["per_repeat"])


def oracle_best(cands):
    """The envelope's pick among the oracle settings' runs at one load: the lowest p90 TTFT
    (a run with 1 % errors or more, or no TTFT, only when nothing else ran)."""
    def key(s):
        bad = s["errors"] >= 0.01 * max(1, s["requests"]) or p90(s, "ttft_sim_s") is None
        return (bad, p90(s, "ttft_sim_s") or float("inf"))
    return min(cands, key=key)


class Runner:
    """Every run of one scenario, cached by policy, load and repeat: the sweep and the goodput
    bisection ask for points, and a point already run is never run again. run_cell(cfg, policy,
    load, rawdir, rep, oracle=None) runs one (cell.run_cell)."""

    def __init__(self, cfg, sres, rawdir, run_cell):
        self.cfg, self.sres, self.rawdir, self.run_cell = cfg, sres, rawdir, run_cell

    def point(self, pol, load, rep=0):
        load = rnd(load)
        key = f"{load:g}"
        r = self.sres["policies"].setdefault(pol, {"runs": {}})
        if rep == 0:
            if key not in r["runs"]:
                r["runs"][key] = self._run(pol, load, 0)
            return r["runs"][key]
        reps = r.setdefault("repeats", {}).setdefault(key, [])
        while len(reps) < rep:
            reps.append(self._run(pol, load, len(reps) + 1))
        return reps[rep - 1]

    def _run(self, pol, load, rep):
        if pol != "oracle":
            return self.run_cell(self.cfg, pol, load, self.rawdir, rep)
        # The oracle envelope: every setting at this load, the one with the lowest p90 TTFT.
        sweep = self.sres.setdefault("oracle_sweep", {})
        cands = []
        for st in self.cfg["oracle_settings"]:
            s = self.run_cell(self.cfg, "oracle", load, self.rawdir, rep, oracle=st)
            sweep.setdefault(oracle_label(st), {"setting": list(st), "runs": {}})["runs"][
                f"{load:g}" + (f"_r{rep}" if rep else "")] = s
            cands.append(s)
        return dict(oracle_best(cands))

    def search(self, pol, slo, stop=None):
        """Bisection of the load knob for the highest load meeting the SLO, to goodput_tol:
        brackets upward (x2, up to goodput_cap x the highest sweep load) while every load meets
        it and downward (/2, down to goodput_floor x the lowest) while none does; inside a
        bracket it alternates the interpolated SLO crossing (kept off the bracket's ends) with
        the probe one tolerance beyond it that closes the bracket if the crossing is where it
        seemed (midpoint when there is nothing to interpolate)."""
        cfg = self.cfg
        tol = cfg["goodput_tol"]
        cap = rnd(max(cfg["speeds"]) * cfg["goodput_cap"])
        floor = rnd(min(cfg["speeds"]) * cfg["goodput_floor"])
        r = self.sres["policies"][pol]
        probes = r.setdefault("probes", {})
        sides = []
        while True:
            pts = points_of(r)
            lo, hi = bracket(pts, cfg, slo)
            if hi is None:
                if lo >= cap:
                    break
                nxt = min(cap, 2 * lo)
            elif lo is None:
                if hi <= floor:
                    break
                nxt = max(floor, hi / 2)
            else:
                w = hi - lo
                if w <= tol * lo * 1.0001:
                    break
                m = max(tol * lo, 0.1 * w)
                c = crossing(pts, cfg, slo, lo, hi)
                if sides and sides[-1][0] == "interp" and w > 2 * tol * lo:
                    # The last probe landed near the crossing: the one that closes the bracket
                    # on its other side, if the crossing is where it seemed.
                    nxt, kind = (lo * (1 + tol) if sides[-1][1] else hi / (1 + tol)), "close"
                elif c is None or lo + m > hi - m:
                    nxt, kind = (lo + hi) / 2, "mid"
                else:
                    nxt, kind = min(max(c, lo + m), hi - m), "interp"
            nxt = rnd(nxt)
            if nxt in pts or probes.get(f"{slo:g}", 0) >= cfg["goodput_max_probes"]:
                break  # the knob's resolution or the probe budget: the bracket stays as it is
            if stop is not None and stop():
                return False  # the time budget: the bracket stays as it is
            s = self.point(pol, nxt)
            probes[f"{slo:g}"] = probes.get(f"{slo:g}", 0) + 1
            sides.append((kind if hi is not None and lo is not None else "outside", meets(s, cfg, slo)))
        return True

    def repeat(self, pol, slo, stop=None):
        """Runs the deciding loads (the final bracket's ends) until each has `repeats` runs;
        False when `stop` cut them short."""
        lo, hi = bracket(points_of(self.sres["policies"][pol]), self.cfg, slo)
        for x in (lo, hi):
            if x is not None:
                for j in range(1, self.cfg["repeats"]):
                    reps = self.sres["policies"][pol].get("repeats", {}).get(f"{rnd(x):g}", [])
                    if len(reps) < j and stop is not None and stop():
                        return False
                    self.point(pol, x, j)
        return True


def bisect_jobs(cfg, sres):
    """(policy, SLO) pairs to bisect. auto: kvroute and kvroute-tuned at every bisected SLO, the
    peer with the best sweep goodput at each, both of them at any other SLO the sweep leaves
    a close call (`bisect_close`), round-robin at 2 s where the 3x target needs it (only with
    bisect_rr, --set bisect_rr=true);
    all: every policy run but the oracle; else the comma-separated policies at every SLO."""
    pols = [p for p, r in sres["policies"].items() if r.get("runs")]
    spec = cfg["bisect"]
    slos = [s for s in cfg["slos"] if s in cfg["bisect_slos"]]
    if spec == "all":
        return [(p, s) for p in pols if p != "oracle" for s in slos]
    if spec != "auto":
        want = spec.split(",")
        return [(p, s) for p in pols if p in want for s in slos]
    jobs = [(p, s) for p in pols if p.startswith("kvroute") for s in slos]
    for s in slos:
        peer = best_peer_by_sweep(cfg, sres, pols, s)
        if peer:
            jobs.append((peer, s))
            jobs += [(p, s) for p in peers_tied_at_top(cfg, sres, pols, s, peer) if (p, s) not in jobs]
    for s in close_calls(cfg, sres, pols, slos):
        jobs += [j for j in [("kvroute", s), (best_peer_by_sweep(cfg, sres, pols, s), s)] if j not in jobs]
    if cfg["bisect_rr"] and cfg["scenario"] in TARGET_3X_RR and "envoy-round-robin" in pols and 2.0 in slos:
        jobs.append(("envoy-round-robin", 2.0))
    return jobs


def best_peer_by_sweep(cfg, sres, pols, slo):
    """The peer with the most goodput read off the sweep; among peers that all missed the SLO
    at the lowest load, the one that came closest there; among peers that all met it at the
    highest load, the one with the most headroom there (the likeliest to go furthest)."""
    def key(p):
        pts = points_of(sres["policies"][p])
        g = goodput_result(sres["policies"][p], cfg, slo, "sweep")
        at = (max(pts) if g and g["kind"] == ">=" else min(pts)) if pts else None
        m = slo_metric(pts[at], cfg, slo) if at is not None else None
        return (g["value"] if g else 0.0, -(m if m is not None else 1e9))
    peers = [p for p in PEERS if p in pols]
    return max(peers, key=key) if peers else None


def peers_tied_at_top(cfg, sres, pols, slo, best):
    """Other peers that, like `best`, met the SLO at every load of the sweep: the sweep cannot
    rank them (headroom at its top load is a guess, decided on docqa by a 2 % difference in
    TPOT), so each is bisected too."""
    def at_cap(p):
        g = goodput_result(sres["policies"][p], cfg, slo, "sweep")
        return bool(g) and g["kind"] == ">="
    if not at_cap(best):
        return []
    return [p for p in PEERS if p in pols and p != best and at_cap(p)]


def close_calls(cfg, sres, pols, bisected):
    """The SLOs outside `bisected` where kvroute against the best peer is not settled by the
    sweep (`bisect_close`): read-off goodputs within that factor (a miss at the lowest load
    counting as that load), or both missing at the lowest load."""
    band = cfg.get("bisect_close") or 0.0
    if band <= 0 or "kvroute" not in pols:
        return []
    low = min(cfg["speeds"])
    out = []
    for s in cfg["slos"]:
        peer = best_peer_by_sweep(cfg, sres, pols, s)
        if s in bisected or peer is None:
            continue
        k = goodput_result(sres["policies"]["kvroute"], cfg, s, "sweep")
        g = goodput_result(sres["policies"][peer], cfg, s, "sweep")
        if not k or not g or (k["kind"] == ">=" and g["kind"] == ">="):
            continue
        # A miss at the lowest load is a goodput somewhere below it: against the other side's
        # read-off that is close only if that is near the lowest load too.
        vk, vg = (low if x["kind"] == "<" else x["value"] for x in (k, g))
        both_missed = k["kind"] == "<" and g["kind"] == "<"
        if both_missed and far_above_slo_at(cfg, sres, ["kvroute", peer], s, low):
            continue
        if both_missed or (vk > 0 and vg > 0 and max(vk, vg) / min(vk, vg) <= 1 + band):
            out.append(s)
    return out


def far_above_slo_at(cfg, sres, pols, slo, load):
    """Every one of `pols` missed `slo` at `load` by `bisect_close_floor_ratio` or more."""
    limit = cfg.get("bisect_close_floor_ratio") or 0.0
    if limit <= 0:
        return False
    for p in pols:
        pt = points_of(sres["policies"][p]).get(load)
        m = slo_metric(pt, cfg, slo) if pt else None
        if m is None or m < limit:  # an error miss: a lower load may answer it
            return False
    return True
