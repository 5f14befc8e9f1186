"""The benchmark's goodput read-off (bench/kvbench), on made-up sweep points: what results.md
claims is only as good as this arithmetic."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from kvbench import config, goodput, suite  # noqa: E402

CFG = dict(config.COMMON, tpot_slo_s=0.1)


def point(ttft_p90: float, tpot_p90: float, errors: int = 0) -> dict:
    return dict(requests=100, errors=errors, ttft_sim_s=dict(p90=ttft_p90), tpot_sim_s=dict(p90=tpot_p90))


def test_a_tpot_bound_miss_is_interpolated_on_tpot_not_on_the_ttft_ratio():
    # Met at 12 with TTFT at half its SLO and TPOT far below; missed at 24 on TPOT alone.
    pts = {12.0: point(1.0, 0.012), 24.0: point(1.9, 0.19)}
    x = goodput.crossing(pts, CFG, 2.0, 12.0, 24.0)
    # TPOT's own log crossing: 12 + 12 * ln(1/0.12) / ln(1.9/0.12).
    assert x == pytest.approx(21.2, abs=0.05)
    g = goodput.goodput_result(dict(runs={"12": pts[12.0] | {"offered_rps_sim": 11.0},
                                          "24": pts[24.0] | {"offered_rps_sim": 22.0}}), CFG, 2.0, "sweep")
    assert g["kind"] == "=" and g["value"] == pytest.approx(x)


def test_the_first_ratio_to_cross_decides():
    # TTFT crosses 1 s halfway (log-linear), TPOT only near the top: TTFT decides.
    pts = {10.0: point(0.5, 0.01), 20.0: point(2.0, 0.11)}
    assert goodput.crossing(pts, CFG, 1.0, 10.0, 20.0) == pytest.approx(15.0)


def test_an_error_miss_has_no_crossing():
    pts = {10.0: point(0.5, 0.01), 20.0: point(0.6, 0.02, errors=5)}
    assert goodput.crossing(pts, CFG, 1.0, 10.0, 20.0) is None
    assert not goodput.meets(pts[20.0], CFG, 1.0)


def sweep(points: dict[float, tuple[float, float]]) -> dict:
    return dict(runs={f"{x:g}": point(*p) | {"offered_rps_sim": x} for x, p in points.items()})


def test_both_missing_far_above_the_slo_at_the_lowest_load_is_not_probed_lower():
    cfg = dict(CFG, speeds=[12.0, 24.0, 32.0])
    far = dict(policies={"kvroute": sweep({12.0: (0.98, 0.02), 24.0: (1.5, 0.03), 32.0: (4.5, 0.05)}),
                         "sglang-cache-aware": sweep({12.0: (1.02, 0.02), 24.0: (2.0, 0.03), 32.0: (5.0, 0.05)})})
    assert 0.5 not in goodput.close_calls(cfg, far, list(far["policies"]), [2.0])
    # Just above the SLO at the lowest load: a lower load may meet it, so it is probed.
    near = dict(policies={"kvroute": sweep({12.0: (0.6, 0.02), 24.0: (1.5, 0.03), 32.0: (4.5, 0.05)}),
                          "sglang-cache-aware": sweep({12.0: (1.02, 0.02), 24.0: (2.0, 0.03), 32.0: (5.0, 0.05)})})
    assert 0.5 in goodput.close_calls(cfg, near, list(near["policies"]), [2.0])
    assert 0.5 in goodput.close_calls(dict(cfg, bisect_close_floor_ratio=0), far, list(far["policies"]), [2.0])


def fake_scenario(monkeypatch, deadline):
    """run_scenario on made-up runs: p90 TTFT grows with the load, kvroute a little faster than
    sglang-router, so the 2 s SLO is bisected (the targets need it) and 1 s is a close call."""
    runs = []

    def fake_run_cell(cfg, policy, speed, rawdir, rep=0, oracle=None):
        runs.append((policy, speed, rep))
        k = 0.060 if policy == "kvroute" else 0.064
        return point(k * speed, 0.02) | {"offered_rps_sim": speed, "ttft_sim_s": dict(p50=0.0, p90=k * speed, p99=0.0),
                                         "tpot_sim_s": dict(p50=0.02, p90=0.02),
                                         "e2e_sim_s": dict(p50=0.0), "throughput_rps_sim": speed, "hit_rate": 0.5,
                                         "max_over_mean_requests": 1.0}
    monkeypatch.setattr(suite, "run_cell", fake_run_cell)
    monkeypatch.setattr(suite, "resolve_capacity", lambda cfg, logdir: None)
    cfg = config.scenario_config(config.PRESETS["full"], "conversation", "dev", {"deadline": deadline})
    sres = suite.run_scenario(cfg, ["kvroute", "sglang-cache-aware"], "/nonexistent")
    return sres, runs


def test_the_time_budget_skips_close_calls_but_never_the_bisection_the_targets_need(monkeypatch):
    free, free_runs = fake_scenario(monkeypatch, None)
    assert ["kvroute", 1.0] in free["bisected"] and ["kvroute", 2.0] in free["bisected"]
    assert free["budget"] == dict(allowance_s=None, skipped=[], cut=[])
    # Past its share of the budget before the bisection starts: the 2 s bisection and its
    # repeats run as before, the close calls are read off the sweep and listed.
    late, late_runs = fake_scenario(monkeypatch, 0.0)
    assert ["kvroute", 1.0] not in late["bisected"] and ["kvroute", 2.0] in late["bisected"]
    assert ["kvroute", 1.0] in late["budget"]["skipped"] and late["budget"]["cut"] == []
    assert len(late_runs) < len(free_runs)
    assert late["policies"]["kvroute"]["goodput"]["2"] == free["policies"]["kvroute"]["goodput"]["2"]
    assert late["policies"]["kvroute"]["goodput"]["1"]["method"] == "sweep"


def test_the_budget_is_shared_in_proportion_to_the_scenarios_expected_times():
    rest = ["conversation", "docqa"]
    exp = [suite.scenarios.SCENARIOS[n]["expected_s"] for n in rest]
    assert suite.scenario_deadline(1000.0, 0.0, rest) == pytest.approx(1000.0 * exp[0] / sum(exp))
    # Nothing left: no close calls at all.
    assert suite.scenario_deadline(1000.0, 1200.0, rest) == 1200.0


def test_a_close_call_the_budget_stops_midway_keeps_its_bracket_and_is_listed(monkeypatch):
    _, core_runs = fake_scenario(monkeypatch, 0.0)
    n_core = len(core_runs)
    # A clock that ticks once per run. The sweep and the 2 s bisection take 12 runs (its
    # repeats come last); the budget runs out during the first close call's second probe.
    clock = []
    monkeypatch.setattr(suite.time, "time", lambda: float(len(clock)))
    monkeypatch.setattr(suite, "run_cell", (lambda f: lambda *a, **k: (clock.append(1), f(*a, **k))[1])(suite.run_cell))
    cfg = config.scenario_config(config.PRESETS["full"], "conversation", "dev", {"deadline": 13.5})
    sres = suite.run_scenario(cfg, ["kvroute", "sglang-cache-aware"], "/nonexistent")
    assert sres["budget"]["cut"] == [["kvroute", 0.5]]
    assert sorted(map(tuple, sres["budget"]["skipped"])) == [("kvroute", 1.0), ("sglang-cache-aware", 0.5),
                                                          ("sglang-cache-aware", 1.0)]
    assert ["kvroute", 0.5] in sres["bisected"] and ["sglang-cache-aware", 0.5] not in sres["bisected"]
    # Every core run still ran (the sweep, the 2 s bisection, its repeats), and two probes more.
    assert len(clock) == n_core + 2
