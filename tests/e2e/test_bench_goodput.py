"""The benchmark's goodput read-off (bench/run.py), on made-up sweep points: what results.md
claims is only as good as this arithmetic."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import run  # noqa: E402

CFG = dict(run.COMMON, tpot_slo_s=0.1)


def point(ttft_p90: float, tpot_p90: float, errors: int = 0) -> dict:
    return dict(requests=100, errors=errors, ttft_sim_s=dict(p90=ttft_p90), tpot_sim_s=dict(p90=tpot_p90))


def test_a_tpot_bound_miss_is_interpolated_on_tpot_not_on_the_ttft_ratio():
    # Met at 12 with TTFT at half its SLO and TPOT far below; missed at 24 on TPOT alone.
    pts = {12.0: point(1.0, 0.012), 24.0: point(1.9, 0.19)}
    x = run.crossing(pts, CFG, 2.0, 12.0, 24.0)
    # TPOT's own log crossing: 12 + 12 * ln(1/0.12) / ln(1.9/0.12).
    assert x == pytest.approx(21.2, abs=0.05)
    g = run.goodput_result(dict(runs={"12": pts[12.0] | {"offered_rps_sim": 11.0},
                                      "24": pts[24.0] | {"offered_rps_sim": 22.0}}), CFG, 2.0, "sweep")
    assert g["kind"] == "=" and g["value"] == pytest.approx(x)


def test_the_first_ratio_to_cross_decides():
    # TTFT crosses 1 s halfway (log-linear), TPOT only near the top: TTFT decides.
    pts = {10.0: point(0.5, 0.01), 20.0: point(2.0, 0.11)}
    assert run.crossing(pts, CFG, 1.0, 10.0, 20.0) == pytest.approx(15.0)


def test_an_error_miss_has_no_crossing():
    pts = {10.0: point(0.5, 0.01), 20.0: point(0.6, 0.02, errors=5)}
    assert run.crossing(pts, CFG, 1.0, 10.0, 20.0) is None
    assert not run.meets(pts[20.0], CFG, 1.0)


def sweep(points: dict[float, tuple[float, float]]) -> dict:
    return dict(runs={f"{x:g}": point(*p) | {"offered_rps_sim": x} for x, p in points.items()})


def test_both_missing_far_above_the_slo_at_the_lowest_load_is_not_probed_lower():
    cfg = dict(CFG, speeds=[12.0, 24.0, 32.0])
    far = dict(policies={"kvroute": sweep({12.0: (0.98, 0.02), 24.0: (1.5, 0.03), 32.0: (4.5, 0.05)}),
                         "sglang-cache-aware": sweep({12.0: (1.02, 0.02), 24.0: (2.0, 0.03), 32.0: (5.0, 0.05)})})
    assert 0.5 not in run.close_calls(cfg, far, list(far["policies"]), [2.0])
    # Just above the SLO at the lowest load: a lower load may meet it, so it is probed.
    near = dict(policies={"kvroute": sweep({12.0: (0.6, 0.02), 24.0: (1.5, 0.03), 32.0: (4.5, 0.05)}),
                          "sglang-cache-aware": sweep({12.0: (1.02, 0.02), 24.0: (2.0, 0.03), 32.0: (5.0, 0.05)})})
    assert 0.5 in run.close_calls(cfg, near, list(near["policies"]), [2.0])
    assert 0.5 in run.close_calls(dict(cfg, bisect_close_floor_ratio=0), far, list(far["policies"]), [2.0])
