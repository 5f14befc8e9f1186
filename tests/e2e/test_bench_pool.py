"""kvroute-pool in the benchmark (bench/kvbench, issue 43): its prefill pool is taken from the
same workers every other policy routes over, and a pool that only kvroute has is never judged
against peers that did not get it."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from kvbench import config, targets  # noqa: E402
from kvbench.report import markdown  # noqa: E402

CFG = dict(config.COMMON, scenario="docqa", load_name="rate", speeds=[12.0, 24.0], goodput=False)


def runs(p50: float, hit: float) -> dict:
    x = dict(requests=100, errors=0, ttft_sim_s=dict(p50=p50, p90=2 * p50), tpot_sim_s=dict(p90=0.02),
             hit_rate=hit, offered_rps_sim=10.0, max_over_mean_requests=1.1)
    return {"runs": {"12": x, "24": x}}


def test_the_pool_comes_out_of_the_same_workers_and_only_for_kvroute_pool():
    assert config.fleet_split(CFG, "kvroute-pool") == (6, 2)  # a quarter of 8
    for pol in ("kvroute", "sglang-cache-aware", "oracle", "dynamo-kv-tuned"):
        assert config.fleet_split(CFG, pol) == (8, 0)
    assert config.fleet_split(dict(CFG, workers=4), "kvroute-pool") == (3, 1)
    assert config.fleet_split(dict(CFG, workers=4, pool_workers=2), "kvroute-pool") == (2, 2)
    assert config.cell_cfg(CFG, "kvroute") is CFG


@pytest.mark.parametrize("bad", [dict(pool_workers=0), dict(pool_workers=8), dict(prefill_workers=2)])
def test_bad_pool_settings_are_refused(bad):
    with pytest.raises(ValueError):
        config.cell_cfg(dict(CFG, **bad), "kvroute-pool")


def test_the_legacy_pool_leaves_kvroute_s_targets_unjudged():
    res = {"policies": {"kvroute": runs(0.5, 0.7), "sglang-cache-aware": runs(1.9, 0.6)}}
    same = targets.targets(CFG, res)
    assert any(t["status"] == "met" for t in same)
    legacy = targets.unequal_fleets(dict(CFG, prefill_workers=2), same)
    assert legacy and all(t["status"].startswith("not comparable (kvroute had 2 prefill") for t in legacy)
    assert targets.unequal_fleets(CFG, same) == same


def test_the_pool_row_is_its_own_row_beside_the_targets_of_kvroute_without_it():
    # The pool far ahead, kvroute level with the peer: kvroute's targets read kvroute's numbers.
    res = {"policies": {"kvroute": runs(2.17, 0.61), "kvroute-pool": runs(0.5, 0.55),
                        "sglang-cache-aware": runs(1.9, 0.61)}}
    t = targets.targets(CFG, res)
    p50 = next(x for x in t if x["target"].startswith("TTFT p50"))
    assert p50["status"] == "missed" and "1.900 <= 2.170" in p50["reference"]
    rows = targets.pool_rows(CFG, res)
    assert len(rows) == 2 and all(r["status"] == "pool" for r in rows)
    assert rows[0]["target"].startswith("kvroute-pool (6 decode + 2 pool of the same 8)")
    assert rows[0]["value"].startswith("0.500 / 1.000 s") and rows[0]["reference"].startswith("sglang-cache-aware: 1.900")
    assert markdown.row_label(CFG, "kvroute-pool") == "kvroute-pool (6 + 2 pool)"
    assert markdown.row_label(CFG, "kvroute") == "kvroute"
    assert markdown.row_label(dict(CFG, prefill_workers=2), "sglang-cache-aware") == "sglang-cache-aware (6)"
    assert "except kvroute-pool: 6 decode + 2" in markdown.pool_note(CFG, ["kvroute", "kvroute-pool"])
