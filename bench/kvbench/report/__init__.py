"""results.md and the plots, written from results.json alone (markdown.py, plots.py): what a run
writes when it ends, and what --report-only rewrites from a committed record."""

import json
import os

from kvbench.config import COMMON
from kvbench.paths import ROOT
from kvbench.report.markdown import write_markdown
from kvbench.report.plots import write_plots
from kvbench.targets import analyze, annotate

__all__ = ["report_only", "write_markdown", "write_plots"]


def report_only(name):
    """Redoes the analysis of bench/results/<name>/results.json (goodput, tables, targets, with
    today's code) and rewrites it, its results.md and its plots."""
    outdir = os.path.join(ROOT, "bench", "results", name)
    with open(os.path.join(outdir, "results.json")) as f:
        res = json.load(f)
    for sres in res["scenarios"].values():
        cfg = dict(COMMON, goodput=False, repeats=1, bisect="auto")
        cfg.update(sres["config"])
        sres["config"] = cfg
        analyze(cfg, sres)
        annotate(sres)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(outdir, "results.md"))
    write_plots(res, outdir)
