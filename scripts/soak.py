#!/usr/bin/env python3
"""Soak test: a real Envoy with the built kvroute.wasm (--concurrency 2) in front of mock
workers, under thousands of mixed requests for a fixed time (`make soak`, mk/soak.mk).

The mix: completions and chat, streaming and not, text and token-id prompts over a few
shared prefixes, cold prompts long enough for the prefill pool, a third of the requests
cancelled by the client mid-stream (or mid-generation when not streaming), some aborted
while the body is being sent, and malformed bodies. During the run Envoy's RSS is sampled;
at the end the script checks, and prints:
  * every valid request that was not cancelled got 200 and a complete answer, every
    malformed one a 4xx (never a 5xx);
  * every kvroute load gauge (per-worker inflight, prefill tokens, active blocks, and the
    active request count) reads 0 once the load stops, with no request expired by the TTL:
    the release path alone freed everything;
  * Envoy's RSS after warm-up grows less than --max-growth (the curve is printed);
  * no VM panicked.
Exit status 0 when all hold. Standard library only (asyncio with raw HTTP/1.1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvstack import Stack, Worker, request, text  # noqa: E402

MODEL = "mock-model"
LOAD_GAUGES = ("kvroute_worker_inflight", "kvroute_worker_prefill_tokens", "kvroute_worker_active_blocks",
               "kvroute_active_requests")


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=float(env("SOAK_SECONDS", "600")),
                   help="load duration (default 600; env SOAK_SECONDS)")
    p.add_argument("--clients", type=int, default=int(env("SOAK_CLIENTS", "48")), help="concurrent clients")
    p.add_argument("--sample", type=float, default=float(env("SOAK_SAMPLE", "5")), help="RSS sample period (s)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds excluded from the RSS verdict (default: a quarter of the run, at least 30)")
    p.add_argument("--max-growth", type=float, default=float(env("SOAK_MAX_GROWTH", "10")),
                   help="allowed RSS growth after warm-up, percent")
    p.add_argument("--speedup", type=float, default=40.0, help="mock worker speedup")
    p.add_argument("--min-requests", type=int, default=None,
                   help="requests the run must reach (default: 1000, or 5 per second for short runs)")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


# ---- the request mix

class Mix:
    """Random requests over a fixed set of shared prefixes."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.docs = [text(7000 + i, rng.randint(1500, 6000)) for i in range(10)]
        self.token_docs = [[(i * 7919 + k * 31) % 32000 + 1 for k in range(rng.randint(64, 600))] for i in range(6)]
        self.n = 0

    def pick(self) -> tuple[str, str, bytes, bool, bool]:
        """(kind, path, body, stream, cancel). kind names the row in the summary."""
        r, self.n = self.rng, self.n + 1
        roll = r.random()
        if roll < 0.08:
            path, body = self.malformed()
            return "malformed", path, body, False, False
        cancel = r.random() < 1 / 3
        stream = r.random() < 0.5
        # A cancelled request generates long enough that the client leaves mid-answer.
        max_tokens = r.randint(120, 300) if cancel else r.randint(2, 24)
        if roll < 0.40:
            kind, path, body = "completion", "/v1/completions", {"prompt": f"{r.choice(self.docs)} q{self.n}"}
        elif roll < 0.52:
            ids = r.choice(self.token_docs) + [r.randint(1, 32000) for _ in range(r.randint(1, 40))]
            kind, path, body = "tokens", "/v1/completions", {"prompt": ids}
        elif roll < 0.90:
            turns = [{"role": "system", "content": r.choice(self.docs)}]
            for t in range(r.randint(1, 4)):
                turns.append({"role": "user", "content": f"turn {t}: {text(self.n * 10 + t, 120)}"})
                turns.append({"role": "assistant", "content": text(self.n * 10 + t + 5, 80)})
            turns.append({"role": "user", "content": f"last question {self.n}"})
            kind, path, body = "chat", "/v1/chat/completions", {"messages": turns}
        else:
            # Cold and long: above the disaggregation threshold, so the prefill pool is used.
            kind, path, body = "cold", "/v1/completions", {"prompt": text(10_000_000 + self.n, r.randint(9000, 16000))}
        body.update(model=MODEL, max_tokens=max_tokens, stream=stream)
        if stream and r.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
        return kind, path, json.dumps(body).encode(), stream, cancel

    def malformed(self) -> tuple[str, bytes]:
        r = self.rng
        choices = [
            ("/v1/completions", b'{"model":"mock-model","prompt":"unterminated'),
            ("/v1/completions", b"not json at all"),
            ("/v1/completions", b'{"model":"mock-model","prompt":{"x":1},"max_tokens":4}'),
            ("/v1/completions", b'{"model":"mock-model","prompt":[],"max_tokens":4}'),
            ("/v1/completions", b'[1,2,3]'),
            ("/v1/chat/completions", b'{"model":"mock-model","messages":[],"max_tokens":4}'),
            ("/v1/chat/completions", b'{"model":"mock-model","messages":"hi","max_tokens":4}'),
            ("/v1/chat/completions", bytes(r.randrange(256) for _ in range(r.randint(1, 200)))),
            ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"x"}],"max_tokens":-5}'),
            ("/v1/completions", b'{"prompt":"x","max_tokens":4' + b',"a":[' * 300),
        ]
        return r.choice(choices)


# ---- one request over raw HTTP/1.1

async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def one(port: int, path: str, body: bytes, stream: bool, cancel: bool, abort_upload: bool,
              rng: random.Random) -> tuple[str, int]:
    """Returns (outcome, status): ok, cancelled, aborted, bad (wrong status or answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (f"POST {path} HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        if abort_upload:
            # The filter has paused the request waiting for the body; the client goes away.
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.2))
            return "aborted", 0
        writer.write(head + body)
        await writer.drain()
        if cancel and not stream:
            await asyncio.sleep(rng.uniform(0.01, 0.3))
            return "cancelled", 0
        status, headers = await read_head(reader)
        if cancel:
            # Leave after the first piece of the stream (if that already held the end,
            # the answer was quicker than the client: counted apart).
            first = await reader.read(rng.randint(1, 4096))
            return ("cancelled" if b"[DONE]" not in first else "finished-first"), status
        data = await reader.read()
        if status != 200:
            return "bad", status
        if stream:
            complete = b"data: [DONE]" in data
        else:
            complete = b'"usage"' in data and data.rstrip().endswith(b"}")
        return ("ok" if complete else "bad"), status
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class Tally:
    def __init__(self):
        self.outcomes = Counter()
        self.statuses = Counter()
        self.bad: list[str] = []
        self.done = 0

    def add(self, kind: str, outcome: str, status: int, detail: str = "") -> None:
        self.done += 1
        self.outcomes[(kind, outcome)] += 1
        if status:
            self.statuses[status] += 1
        if outcome == "bad" and len(self.bad) < 10:
            self.bad.append(f"{kind} -> {status} {detail}")


async def client(port: int, mix: Mix, tally: Tally, stop_at: float, rng: random.Random) -> None:
    while time.monotonic() < stop_at:
        kind, path, body, stream, cancel = mix.pick()
        abort_upload = kind != "malformed" and not cancel and rng.random() < 0.03
        try:
            outcome, status = await asyncio.wait_for(one(port, path, body, stream, cancel, abort_upload, rng), 120)
        except (asyncio.TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as e:
            tally.add(kind, "bad", 0, repr(e))
            continue
        if kind == "malformed":
            outcome = "ok" if 400 <= status < 500 else "bad"
        if abort_upload:
            kind = "aborted-upload"
        tally.add(kind, outcome, status)


# ---- Envoy observations

def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def heap_bytes(admin: int) -> int:
    try:
        _, _, body = request(admin, "GET", "/memory", timeout=5)
        return int(json.loads(body).get("allocated", 0))
    except (OSError, ValueError):
        return 0


def load_gauges(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.split("{")[0] in LOAD_GAUGES}


async def sampler(stack: Stack, tally: Tally, t0: float, period: float, samples: list, stop: asyncio.Event):
    while not stop.is_set():
        t = time.monotonic() - t0
        gauges = load_gauges(await asyncio.to_thread(stack.stats))
        inflight = sum(v for k, v in gauges.items() if k.startswith("kvroute_worker_inflight"))
        heap = await asyncio.to_thread(heap_bytes, stack.admin)
        samples.append((t, rss_kb(stack.envoy.pid), heap, tally.done, inflight))
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass


async def run_load(stack: Stack, args, tally: Tally, samples: list) -> float:
    rng = random.Random(args.seed)
    mix = Mix(rng)
    t0 = time.monotonic()
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(stack, tally, t0, args.sample, samples, stop))
    stop_at = t0 + args.seconds
    await asyncio.gather(*(client(stack.listen, mix, tally, stop_at, random.Random(args.seed * 1000 + i))
                           for i in range(args.clients)))
    stop.set()
    await sampling
    return time.monotonic() - t0


def wait_drained(stack: Stack, timeout: float = 30.0) -> tuple[dict, float]:
    """Load gauges once every one reads 0 (or at the timeout), and the seconds that took."""
    t0 = time.monotonic()
    while True:
        gauges = load_gauges(stack.stats())
        if gauges and all(v == 0 for v in gauges.values()):
            return gauges, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return gauges, time.monotonic() - t0
        time.sleep(0.5)


def main() -> int:
    args = parse_args()
    min_requests = args.min_requests if args.min_requests is not None else int(min(1000, 5 * args.seconds))
    warmup = args.warmup if args.warmup is not None else max(30.0, args.seconds / 4)
    fleet = [Worker(f"decode-{i}", role="decode") for i in range(1, 4)] + [Worker("prefill-1", role="prefill")]
    stack = Stack(fleet, kvroute={"disaggregation": {"threshold_tokens": 2000}}, speedup=args.speedup,
                  concurrency=2)
    print(f"soak: {args.seconds:.0f}s, {args.clients} clients, Envoy --concurrency 2, "
          f"workers {[w.name for w in fleet]}, logs in {stack.dir}", flush=True)
    stack.start()
    tally, samples = Tally(), []
    try:
        elapsed = asyncio.run(run_load(stack, args, tally, samples))
        gauges, drain_s = wait_drained(stack)
        stats = stack.stats()
        final_rss = rss_kb(stack.envoy.pid)
        log = stack.envoy_log()
    finally:
        stack.stop()

    # ---- report
    print(f"\nrequests: {tally.done} in {elapsed:.0f}s ({tally.done / max(elapsed, 1e-9):.1f}/s)")
    kinds = sorted({k for k, _ in tally.outcomes})
    for kind in kinds:
        row = {o: n for (k, o), n in tally.outcomes.items() if k == kind}
        print(f"  {kind:15s} " + "  ".join(f"{o} {n}" for o, n in sorted(row.items())))
    print(f"  statuses: {dict(sorted(tally.statuses.items()))}")
    for line in tally.bad:
        print(f"  bad: {line}")
    cancelled = sum(n for (_, o), n in tally.outcomes.items() if o in ("cancelled", "aborted"))
    print(f"  cancelled or aborted by the client: {cancelled} ({100 * cancelled / max(tally.done, 1):.0f}%)")
    late = sum(n for (_, o), n in tally.outcomes.items() if o == "finished-first")
    if late:
        print(f"  meant to cancel, but the whole stream came in the first read: {late}")

    # At most about 60 rows: every sample of a short run, every n-th (and the last) of a long one.
    step = max(1, -(-len(samples) // 60))
    shown = samples[::step] + ([samples[-1]] if samples and (len(samples) - 1) % step else [])
    print(f"\nEnvoy RSS and heap (tcmalloc allocated) over time, every {step * args.sample:.0f}s:")
    print("     t(s)  rss MiB heap MiB   requests  inflight")
    for t, rss, heap, done, inflight in shown:
        mark = " warm-up" if t < warmup else ""
        print(f"  {t:7.0f} {rss / 1024:7.1f} {heap / 2**20:7.1f} {done:10d} {inflight:9.0f}{mark}")
    after = [s for s in samples if s[0] >= warmup]
    rss_ok = False
    if len(after) >= 2:
        base = after[0][1]
        tail = statistics.median(s[1] for s in after[-3:])
        peak = max(s[1] for s in after)
        growth = 100 * (tail - base) / base
        rss_ok = growth < args.max_growth
        print(f"RSS after warm-up ({warmup:.0f}s): {base / 1024:.1f} MiB -> {tail / 1024:.1f} MiB at the end "
              f"(peak {peak / 1024:.1f}), growth {growth:+.1f}% (limit {args.max_growth:.0f}%); "
              f"after drain {final_rss / 1024:.1f} MiB")
    else:
        print(f"RSS: too few samples after the {warmup:.0f}s warm-up for a verdict (run longer)")

    print(f"\nkvroute load gauges {drain_s:.1f}s after the last request:")
    for k, v in sorted(gauges.items()):
        print(f"  {k} {v:.0f}")
    counters = {k: v for k, v in stats.items() if k.startswith(("kvroute_requests_total", "kvroute_fallbacks_total",
                                                                 "kvroute_expired_requests_total",
                                                                 "kvroute_disagg_decisions_total",
                                                                 "kvroute_host_errors_total", "kvroute_index_"))}
    for k, v in sorted(counters.items()):
        print(f"  {k} {v:.0f}")
    expired = stats.get("kvroute_expired_requests_total", 0)
    panics = log.count("panicked")

    checks = [
        ("every valid request answered, every malformed one 4xx", not tally.bad and
         not any(o == "bad" for (_, o) in tally.outcomes)),
        (f"at least {min_requests} requests", tally.done >= min_requests),
        ("load gauges all 0 after the run", bool(gauges) and all(v == 0 for v in gauges.values())),
        ("no request released by the TTL", expired == 0),
        (f"RSS growth after warm-up < {args.max_growth:.0f}%", rss_ok),
        ("no VM panic in the Envoy log", panics == 0),
    ]
    print()
    for name, good in checks:
        print(f"{'PASS' if good else 'FAIL'}  {name}")
    verdict = all(good for _, good in checks)
    print(f"soak: {'PASS' if verdict else 'FAIL'}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
