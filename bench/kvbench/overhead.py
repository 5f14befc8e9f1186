"""The proxy-overhead step (`make overhead`, and after the scenarios unless --no-overhead): the
latency and CPU per request that Envoy adds alone, with kvroute and with the ext_proc floor in
front of one instant worker, every path measured interleaved, request by request."""

import json
import os
import shutil
import subprocess
import time

from kvbench import log, paths, peers
from kvbench.config import OVERHEAD_PROMPTS, OVERHEAD_SIZES, overhead_cells
from kvbench.procs import Procs, proc_cpu_s
from kvbench.stack import check_routes, start_envoy, start_fleet


def run_overhead(cfg, rawdir, have_kvroute):
    """Latency Envoy adds with and without kvroute in front of one instant worker."""
    out = {"sizes": OVERHEAD_SIZES, "prompts": OVERHEAD_PROMPTS, "targets": {}}
    cell = os.path.join(rawdir, "overhead")
    shutil.rmtree(cell, ignore_errors=True)
    os.makedirs(cell)
    started = list(Procs.live)
    try:
        ws = start_fleet(cfg, cell, n=1, speedup=1e6, kv_blocks=16384)
        targets = {"direct": ws[0]["url"]}
        p, url, _ = start_envoy(cfg, "envoy-round-robin", ws, os.path.join(cell))
        targets["envoy"] = url
        # Whose CPU is read per request: each path's Envoy (and the ext_proc picker).
        cpu_procs = {"envoy": [p]}
        if have_kvroute:
            kdir = os.path.join(cell, "kvroute")
            os.makedirs(kdir, exist_ok=True)
            try:
                t_kv = time.time()
                p2, url2, admin2 = start_envoy(dict(cfg, kv_blocks=16384), "kvroute", ws, kdir)
                check_routes(url2, [p2], "kvroute", [admin2])
                targets["envoy+kvroute"] = url2
                cpu_procs["envoy+kvroute"] = [p2]
                # For its first 10 s every kvroute VM takes replication messages at once
                # (STARTUP_URGENT_MS in src/filter/state.rs); measure the steady state after it.
                time.sleep(max(0.0, t_kv + 11 - time.time()))
            except Exception as e:
                out["kvroute_error"] = str(e)
                log(f"overhead: kvroute could not run: {e}")
        try:
            p3, picker, url3 = peers.start_extproc(cfg, ws, os.path.join(cell, "extproc"))
            check_routes(url3, [p3, picker], "envoy+extproc")
            targets["envoy+extproc"] = url3
            cpu_procs["envoy+extproc"] = [p3]
            cpu_procs["extproc picker"] = [picker]
        except Exception as e:
            out["extproc_error"] = str(e)
            log(f"overhead: the ext_proc floor could not run: {e}")
        names = list(targets)
        res = {name: {} for name in names}
        # Latency: all paths measured interleaved, request by request (each path gets the same
        # prompts in the same order), per prompt size and kind.
        by_url = {u: k for k, u in targets.items()}
        out["cpu_ms_per_request"] = cpu = {k: {} for k in cpu_procs}
        for n, reqs in zip(OVERHEAD_SIZES, cfg["overhead_requests"]):
            d = os.path.join(cell, f"lat{n}")
            c0 = {k: proc_cpu_s(v) for k, v in cpu_procs.items()}
            subprocess.run([paths.LOADGEN, "--mode", "latency", "--target", ",".join(targets[k] for k in names),
                            "--prompt-tokens", str(n), "--prompts", ",".join(OVERHEAD_PROMPTS),
                            "--requests", str(reqs), "--concurrency", "1", "--model", paths.MODEL, "--out", d],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            # Per path: its requests of every prompt kind plus loadgen's 5 warm-up requests each.
            per_path = len(OVERHEAD_PROMPTS) * (reqs + 5)
            for k, v in cpu_procs.items():
                cpu[k][str(n)] = round(1e3 * (proc_cpu_s(v) - c0[k]) / per_path, 4)
            with open(os.path.join(d, "summary.json")) as f:
                for r in json.load(f)["results"]:
                    res[by_url[r["target"]]][f"{r['prompt_kind']}{n}"] = r
        for name in names:
            d = os.path.join(cell, name.replace("+", "_"), "saturate")
            subprocess.run([paths.LOADGEN, "--mode", "saturate", "--target", targets[name], "--prompt-tokens", "100",
                            "--concurrency", "32", "--duration-s", str(cfg["saturate_s"]), "--model", paths.MODEL,
                            "--threads", "1", "--out", d],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            with open(os.path.join(d, "summary.json")) as f:
                res[name]["saturate"] = json.load(f)["results"][0]
            out["targets"][name] = res[name]
            log(f"overhead {name:14s}: " + ", ".join(
                f"{key}: p50 {res[name][key]['p50_ms']:.3f} ms" for key, _, _ in overhead_cells()) +
                f", saturate {res[name]['saturate']['rps']:.0f} rps")
    finally:
        Procs.stop([p for p in Procs.live if p not in started])
    return out
