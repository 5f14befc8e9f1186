"""bench/precise.py's verdicts (issue 42) and the failure knobs it sets: a wrong kv_blocks reaches
only the workers, and a bypass client on the same corpus shares the gateway's documents."""

from __future__ import annotations

import importlib.util
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
from kvbench import cell, config  # noqa: E402

_spec = importlib.util.spec_from_file_location("precise_bench", os.path.join(BENCH, "precise.py"))
precise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(precise)


def cells(p50, p90, hit):
    return dict(ttft_p50=p50, ttft_p90=p90, hit=hit, tpot_p90=0.02)


def state(by_case):
    """by_case: {case: [(predicted cells, precise cells) per seed]}."""
    return {"runs": {f"{case}/s{i}": {"cells": {"predicted": a, "precise": b}}
                     for case, seeds in by_case.items() for i, (a, b) in enumerate(seeds)}}


def rows_of(st):
    band, rows = precise.verdicts(st, precise.cases("all"))
    return band, {r["case"]: r for r in rows}


def test_no_worse_is_judged_against_the_seeds_spread():
    # Seeds 10 % apart in every no-worse cell: the band is 10 %; precise 5 % slower is within it,
    # 30 % slower is not.
    base = {f"{sc}-{w}w": [(cells(1.0, 2.0, 0.5), cells(1.05, 2.1, 0.5)), (cells(1.1, 2.2, 0.5), cells(1.1, 2.2, 0.5))]
            for sc in ("conversation", "docqa") for w in (8, 4)}
    base["agentic-8w"] = [(cells(1.0, 2.0, 0.5), cells(1.3, 2.6, 0.5)), (cells(1.1, 2.2, 0.5), cells(1.4, 2.9, 0.5))]
    band, rows = rows_of(state(base))
    assert abs(band["ttft_p90"] - 0.1) < 0.02
    assert rows["docqa-8w"]["status"] == "met"
    assert rows["agentic-8w"]["status"].startswith("missed")
    assert rows["burst-4w"]["status"] == "not measured"


def test_repeats_move_the_load_both_ways_and_the_table_shows_each_modes_range():
    # The seed moves tie-breaks only; the load moves the arrival times, alike for both modes.
    assert [round(precise.load_factor(k), 4) for k in range(5)] == [1.0, 1.03, 0.97, 1.06, 0.94]
    st = state({"docqa-8w": [(cells(1.0, 2.0, 0.5), cells(1.0, 2.5, 0.5)), (cells(1.0, 2.2, 0.5), cells(1.0, 2.4, 0.5))]})
    _, rows = rows_of(st)
    assert rows["docqa-8w"]["p90_range"] == "2.000-2.200; 2.400-2.500"


def test_failure_cases_need_a_hit_lead_and_no_slower_ttft():
    aa = {"docqa-8w": [(cells(1.0, 2.0, 0.5), cells(1.0, 2.0, 0.5)), (cells(1.0, 2.0, 0.501), cells(1.0, 2.0, 0.5))]}
    lead = [(cells(1.0, 2.0, 0.60), cells(0.9, 1.8, 0.70))] * 2
    small = [(cells(1.0, 2.0, 0.60), cells(1.0, 2.0, 0.61))] * 2
    faster = [(cells(1.0, 2.0, 0.60), cells(0.8, 2.0, 0.60))] * 2
    slower = [(cells(1.0, 2.0, 0.60), cells(1.5, 3.0, 0.70))] * 2
    _, rows = rows_of(state(dict(aa, **{"bypass-all": lead, "reset": small, "capacity": slower, "bypass-one": faster})))
    assert rows["bypass-all"]["status"] == "met"
    assert "hit lead" in rows["reset"]["status"]
    assert "ttft_p50" in rows["capacity"]["status"]
    assert rows["bypass-one"]["status"] == "met"  # no hit lead, but a faster median


def test_engine_kv_blocks_reaches_the_workers_not_the_router():
    cfg = dict(config.COMMON, mock_preset="llama3-8b-h100", kv_blocks=6144, block_size=16, engine_kv_blocks=3072,
               max_num_seqs=None, max_batched_tokens=None, mock_flags="")
    argv = config.mock_args(cfg)
    assert argv[argv.index("--kv-blocks") + 1] == "3072"
    assert cfg["kv_blocks"] == 6144  # what upstreams() tells kvroute


def test_bypass_on_the_same_corpus_keeps_the_documents_seed(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(cell.subprocess, "Popen", lambda argv, **kw: started.append(argv))
    cfg = dict(config.COMMON, workload="synthetic", seed=606, sessions=300, turns=[1, 4], think_s=1.0,
               loadgen_args=[], speedup=2.0, max_output=64, bypass=0.5, bypass_corpus="same")
    ws = [dict(name="w0", url="http://127.0.0.1:1", role="both")]
    assert cell.start_bypass(cfg, ws, 24.0, str(tmp_path))[1] == []
    argv = started[0]
    assert argv[argv.index("--seed") + 1] == "1606"
    assert argv[argv.index("--corpus-seed") + 1] == "606"
    started.clear()
    cell.start_bypass(dict(cfg, bypass_corpus="own"), ws, 24.0, str(tmp_path))
    assert "--corpus-seed" not in started[0]
    assert argv[argv.index("--target") + 1] == "http://127.0.0.1:1"
