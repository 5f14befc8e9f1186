"""`make demo`, `make run`, `make stop` (ENGINE=llama: on llama.cpp's llama-server instead of
the mock workers).

demo: the same shared-prefix chat workload (pairs of users asking about one long document,
each conversation appending turns) through kvroute and through Envoy's round-robin, each on
a fresh fleet of four mock workers, then a comparison table.
run/stop: the demo stack of envoy/demo.yaml on its fixed ports, in the background.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import envoyconf  # noqa: E402
import kvstack  # noqa: E402
from kvstack import ROOT, Stack, Worker, stream, text, wait_port  # noqa: E402

ENGINE = os.environ.get("ENGINE", "mock")

SPEEDUP = float(os.environ.get("DEMO_SPEEDUP", 2))  # simulated time runs this much faster
KV_BLOCKS = int(os.environ.get("DEMO_KV_BLOCKS", 2048))  # 32k tokens per worker: the workload does not fit in one
APPS = int(os.environ.get("DEMO_APPS", 12))  # users per app share its long document
USERS = int(os.environ.get("DEMO_USERS", 24))
TURNS = int(os.environ.get("DEMO_TURNS", 4))
CONCURRENCY = int(os.environ.get("DEMO_CONCURRENCY", 12))
SYSTEM_CHARS = int(os.environ.get("DEMO_SYSTEM_CHARS", 24000))
TURN_CHARS = int(os.environ.get("DEMO_TURN_CHARS", 2000))


def workload() -> list[list[dict]]:
    """Per user, the chat requests of successive turns. Users of one app share its long
    system prompt; each turn appends to the user's own history."""
    users = []
    for u in range(USERS):
        app = u % APPS
        system = f"You are assistant {app}. " + text(1000 + app, SYSTEM_CHARS)
        users.append((system, u))
    convs = []
    for system, u in users:
        msgs = [{"role": "system", "content": system}]
        turns = []
        for t in range(TURNS):
            msgs = msgs + [{"role": "user", "content": f"user {u} turn {t}: " + text(u * 100 + t, TURN_CHARS)}]
            turns.append({"model": "mock-model", "messages": list(msgs), "max_tokens": 24, "stream": True,
                          "stream_options": {"include_usage": True}})
            msgs = msgs + [{"role": "assistant", "content": text(u * 1000 + t, 300)}]
        convs.append(turns)
    return convs


def run_policy(name: str, kvroute: dict | None) -> dict:
    fleet = [Worker(f"worker-{i}", role="both", kv_blocks=KV_BLOCKS) for i in range(1, 5)]
    results = []
    lock = threading.Lock()
    with Stack(fleet, kvroute=kvroute, speedup=SPEEDUP, concurrency=2) as s:
        convs = workload()

        def user(turns):
            for body in turns:
                status, headers, chunks = stream(s.listen, "/v1/chat/completions", body, timeout=120)
                ttft = chunks[0][0] if chunks else float("nan")
                usage = {}
                for line in b"".join(c for _, c in chunks).decode(errors="replace").split("\n"):
                    if line.startswith("data: {") and '"usage":{' in line:
                        usage = json.loads(line[6:]).get("usage") or usage
                with lock:
                    results.append({"status": status, "ttft_ms": ttft * 1000 * SPEEDUP,
                                    "worker": headers.get("x-worker-id", "?"),
                                    "prompt": usage.get("prompt_tokens", 0),
                                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})

        t0 = time.time()
        with ThreadPoolExecutor(CONCURRENCY) as ex:
            list(ex.map(user, convs))
        wall = time.time() - t0
    ok = [r for r in results if r["status"] == 200]
    ttfts = sorted(r["ttft_ms"] for r in ok)

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    prompt = sum(r["prompt"] for r in ok)
    return {
        "policy": name,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50": pct(0.50),
        "ttft_p99": pct(0.99),
        "hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
        "per_worker": Counter(r["worker"] for r in ok),
        "wall_s": wall,
    }


# ---- ENGINE=llama: two llama-server workers (scripts/llama.sh), real time, engine-reported usage
LLAMA_DOCS = int(os.environ.get("DEMO_LLAMA_DOCS", 6))  # shared long system prompts
LLAMA_USERS = int(os.environ.get("DEMO_LLAMA_USERS", 12))
LLAMA_TURNS = int(os.environ.get("DEMO_LLAMA_TURNS", 3))
LLAMA_CONCURRENCY = int(os.environ.get("DEMO_LLAMA_CONCURRENCY", 4))
LLAMA_DOC_CHARS = int(os.environ.get("DEMO_LLAMA_DOC_CHARS", 6000))
LLAMA_PORTS = (8001, 8002)


def chat_workload(docs: int, users: int, turns: int, doc_chars: int) -> list[list[list[dict]]]:
    """Per user, the message lists of successive turns; users of a document share it."""
    convs = []
    for u in range(users):
        d = u % docs
        msgs = [{"role": "system", "content": f"Document {d}. " + text(1000 + d, doc_chars)}]
        turns_ = []
        for t in range(turns):
            msgs = msgs + [{"role": "user", "content": f"user {u} turn {t}: " + text(u * 100 + t, 400)}]
            turns_.append(list(msgs))
            msgs = msgs + [{"role": "assistant", "content": text(u * 1000 + t, 120)}]
        convs.append(turns_)
    return convs


def llama_workload() -> list[list[list[dict]]]:
    return chat_workload(LLAMA_DOCS, LLAMA_USERS, LLAMA_TURNS, LLAMA_DOC_CHARS)


def measure_chats(s: Stack, name: str, convs: list, model: str, concurrency: int) -> dict:
    """Runs `convs` (each user's turns in order, `concurrency` users at a time) through `s` as
    streamed chats; TTFT in real ms, hits as the engines reported them."""
    results = []
    lock = threading.Lock()

    def user(turns):
        for msgs in turns:
            body = {"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            status, headers, chunks = stream(s.listen, "/v1/chat/completions", body, timeout=300)
            usage = kvstack.sse_usage(chunks)
            with lock:
                results.append({"status": status, "ttft_ms": chunks[0][0] * 1000 if chunks else float("nan"),
                                "worker": headers.get("x-worker-id", "?"),
                                "prompt": usage.get("prompt_tokens", 0),
                                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})

    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(user, convs))
    wall = time.time() - t0
    ok = [r for r in results if r["status"] == 200]
    ttfts = sorted(r["ttft_ms"] for r in ok)

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    prompt = sum(r["prompt"] for r in ok)
    return {"policy": name, "requests": len(results), "errors": len(results) - len(ok),
            "ttft_p50": pct(0.50), "ttft_p90": pct(0.90), "prompt": prompt,
            "cached": sum(r["cached"] for r in ok), "hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
            "per_worker": Counter(r["worker"] for r in ok), "wall_s": wall}


def run_llama_policy(name: str, kvroute: dict | None) -> dict:
    fleet = [kvstack.LlamaWorker(f"llama-{i}") for i in (1, 2)]
    with Stack(fleet, kvroute=kvroute, concurrency=2, site=dict(kvstack.LLAMA_SITE)) as s:
        return measure_chats(s, name, llama_workload(), "tiny-llama", LLAMA_CONCURRENCY)


def print_engine_table(rows: list[dict]) -> int:
    print()
    print("| policy | requests | errors | TTFT p50 (ms) | TTFT p90 (ms) | engine-cached tokens | "
          "cached share of prompt tokens | requests per worker |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        split = " / ".join(f"{w} {r['per_worker'][w]}" for w in sorted(r["per_worker"]))
        print(f"| {r['policy']} | {r['requests']} | {r['errors']} | {r['ttft_p50']:.0f} | {r['ttft_p90']:.0f} "
              f"| {r['cached']} | {r['hit_rate']:.1%} | {split} |")
    rr, kv = rows
    if kv["ttft_p50"] > 0:
        print(f"\nkvroute: TTFT p50 {rr['ttft_p50'] / kv['ttft_p50']:.1f}x lower, p90 "
              f"{rr['ttft_p90'] / kv['ttft_p90']:.1f}x; engine-cached tokens {kv['cached']} vs {rr['cached']}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def demo_llama() -> int:
    if kvstack.llama_paths() is None:
        print("llama-server is not built: make llama (scripts/llama.sh)", file=sys.stderr)
        return 1
    print(f"kvroute demo on llama.cpp: {LLAMA_USERS} users x {LLAMA_TURNS} chat turns sharing {LLAMA_DOCS} "
          f"documents of {LLAMA_DOC_CHARS} chars, {LLAMA_CONCURRENCY} at a time, on 2 llama-server workers "
          f"(1 CPU thread, 4 slots each; tiny random-weight model); times are real")
    rows = []
    for name, cfg in [("envoy round-robin", None), ("kvroute", kvstack.llama_kvroute())]:
        print(f"  running {name} ...", flush=True)
        rows.append(run_llama_policy(name, cfg))
    return print_engine_table(rows)


# ---- ENGINE=vllm: three vLLM CPU workers (scripts/vllm_install.sh), real time, engine-reported usage
VLLM_PORTS = (8001, 8002, 8003)
# 8,192 tokens of KV per engine: the documents fit in the fleet once, not in every engine.
VLLM_KV_BLOCKS = int(os.environ.get("DEMO_VLLM_KV_BLOCKS", 256))
VLLM_DOCS = int(os.environ.get("DEMO_VLLM_DOCS", 6))
VLLM_USERS = int(os.environ.get("DEMO_VLLM_USERS", 12))
VLLM_TURNS = int(os.environ.get("DEMO_VLLM_TURNS", 3))
VLLM_CONCURRENCY = int(os.environ.get("DEMO_VLLM_CONCURRENCY", 4))
VLLM_DOC_CHARS = int(os.environ.get("DEMO_VLLM_DOC_CHARS", 6000))
VLLM_EVENT_PORT = 5557  # engine i publishes on 5557 + i, replays on REPLAY_OFFSET above


def vllm_engines(ports: tuple = (), events: bool = False) -> list:
    n = len(VLLM_PORTS)
    return kvstack.vllm_fleet(n, kv_blocks=VLLM_KV_BLOCKS, kv_events=events, ports=ports,
                              event_ports=tuple((VLLM_EVENT_PORT + i, VLLM_EVENT_PORT + i + REPLAY_OFFSET)
                                                for i in range(n)))


def demo_vllm() -> int:
    if kvstack.vllm_paths() is None:
        print("vLLM is not installed: make vllm (scripts/vllm_install.sh)", file=sys.stderr)
        return 1
    print(f"kvroute demo on vLLM (CPU): {VLLM_USERS} users x {VLLM_TURNS} chat turns sharing {VLLM_DOCS} "
          f"documents of {VLLM_DOC_CHARS} chars, {VLLM_CONCURRENCY} at a time, on 3 vLLM workers "
          f"(1 core each, {VLLM_KV_BLOCKS} KV blocks of {kvstack.VLLM_BLOCK} tokens; tiny random-weight model); "
          f"times are real")
    engines = vllm_engines()
    log_dir = tempfile.mkdtemp(prefix="kvroute-demo-vllm-")
    print(f"  starting the engines (about a minute; logs in {log_dir}) ...", flush=True)
    kvstack.start_vllm(engines, log_dir)
    rows = []
    try:
        for name, cfg in [("envoy round-robin", None), ("kvroute", kvstack.vllm_kvroute(poll_ms=500))]:
            print(f"  running {name} ...", flush=True)
            # The same engines for both policies, their prefix caches emptied in between.
            for w in engines:
                kvstack.vllm_reset_prefix_cache(w)
            s = Stack(engines, kvroute=cfg, concurrency=2, site=dict(kvstack.VLLM_SITE)).start()
            try:
                convs = chat_workload(VLLM_DOCS, VLLM_USERS, VLLM_TURNS, VLLM_DOC_CHARS)
                rows.append(measure_chats(s, name, convs, kvstack.VLLM_MODEL, VLLM_CONCURRENCY))
            finally:
                s.stop(workers=False)
    finally:
        for w in engines:
            w.stop()
    return print_engine_table(rows)


def demo() -> int:
    if ENGINE == "llama":
        return demo_llama()
    if ENGINE == "vllm":
        return demo_vllm()
    print(f"kvroute demo: {USERS} users x {TURNS} chat turns sharing {APPS} long system prompts, "
          f"{CONCURRENCY} at a time, on 4 mock workers ({KV_BLOCKS} KV blocks each, speedup {SPEEDUP:g}; "
          f"real-vLLM signals: ORCA on non-streaming replies only, cached_tokens via "
          f"--enable-prompt-tokens-details as a kvroute user would set)")
    rows = []
    scoring = json.loads(os.environ.get("DEMO_SCORING", "{}"))
    for name, cfg in [("envoy round-robin", None),
                      ("kvroute", {"disaggregation": {"threshold_tokens": 0}, "scoring": scoring})]:
        print(f"  running {name} ...", flush=True)
        rows.append(run_policy(name, cfg))
    print()
    print("| policy | requests | errors | TTFT p50 (ms) | TTFT p99 (ms) | prefix cache hit rate | requests per worker |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        split = " ".join(f"{r['per_worker'][w]}" for w in sorted(r["per_worker"]))
        print(f"| {r['policy']} | {r['requests']} | {r['errors']} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} "
              f"| {r['hit_rate']:.1%} | {split} |")
    rr, kv = rows
    if kv["ttft_p50"] > 0:
        print(f"\nkvroute: TTFT p50 {rr['ttft_p50'] / kv['ttft_p50']:.1f}x lower, "
              f"hit rate {kv['hit_rate']:.1%} vs {rr['hit_rate']:.1%} (times are simulated ms)")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


RUN_DIR = os.path.join(ROOT, "build", "run")
# The fleet envoy/demo.yaml was generated for (scripts/envoyconf.py).
DEMO_WORKERS = envoyconf.demo_fleet()


PRECISE = os.environ.get("PRECISE", "") not in ("", "0")
# `make run PRECISE=1`: KV event ports (ARCHITECTURE.md), replay 100 above, relay on 7000/7001.
KV_EVENT_PORTS = {"decode": 5557, "prefill": 5561}
REPLAY_OFFSET = 100
RELAY_PORTS = (7000, 7001)
MOCK_MODEL = "mock-model"


def kv_event_ports(fleet: list[envoyconf.Upstream]) -> dict[str, int]:
    ports, out = dict(KV_EVENT_PORTS), {}
    for w in fleet:
        out[w.name] = ports[w.role if w.role == "prefill" else "decode"]
        ports[w.role if w.role == "prefill" else "decode"] += 1
    return out


def worker_command(w: envoyconf.Upstream, fleet: list[envoyconf.Upstream]) -> list[str]:
    """The mock worker for `w`. A prefill worker hands its KV only to the decode workers of
    this fleet: a client cannot make it send requests to any address it names."""
    cmd = [kvstack.MOCK, "--port", str(w.port), "--name", w.name, "--role", w.role,
           "--speedup", "10", "--kv-blocks", str(w.kv_blocks), "--enable-prompt-tokens-details"]
    if w.role == "prefill":
        cmd += ["--allowed-decode-endpoints", ",".join(o.endpoint for o in fleet if o.role != "prefill")]
    if PRECISE:
        port = kv_event_ports(fleet)[w.name]
        cmd += ["--kv-events", f"tcp://127.0.0.1:{port}",
                "--kv-events-replay", f"tcp://127.0.0.1:{port + REPLAY_OFFSET}"]
    return cmd


def relay_command(fleet: list[envoyconf.Upstream], port_offset: int = 0) -> list[str]:
    cmd = [kvstack.RELAY, "--model", MOCK_MODEL, "--block-size", "16",
           "--listen", f"127.0.0.1:{RELAY_PORTS[0] + port_offset}",
           "--metrics", f"127.0.0.1:{RELAY_PORTS[1] + port_offset}"]
    for name, port in kv_event_ports(fleet).items():
        cmd += ["--engine", f"{name}=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{port + REPLAY_OFFSET}"]
    return cmd


def llama_bootstrap() -> dict:
    """`make run ENGINE=llama`: Envoy with kvroute (metrics poller on) in front of two
    llama-server workers on 127.0.0.1:8001-8002, from scripts/envoyconf.py."""
    fleet = [envoyconf.Upstream(f"llama-{i}", "127.0.0.1", port, "both", kv_blocks=32768 // kvstack.LLAMA_BLOCK)
             for i, port in enumerate(LLAMA_PORTS, 1)]
    site = envoyconf.Site(wasm=os.path.join(ROOT, "build", "kvroute.wasm"), **kvstack.LLAMA_SITE)
    plugin = {"workers": envoyconf.plugin_workers(fleet), **kvstack.llama_kvroute(), "debug_headers": False}
    return envoyconf.bootstrap(site, fleet, plugin)


def run_llama() -> int:
    stop(quiet=True)
    if kvstack.llama_paths() is None:
        print("llama-server is not built: make llama (scripts/llama.sh)", file=sys.stderr)
        return 1
    os.makedirs(RUN_DIR, exist_ok=True)
    pids = []
    for i, port in enumerate(LLAMA_PORTS, 1):
        w = kvstack.LlamaWorker(f"llama-{i}", port=port)
        w.start(log_dir=RUN_DIR, new_session=True)
        pids.append(w.proc.pid)
    conf = os.path.join(RUN_DIR, "envoy-llama.yaml")
    with open(conf, "w") as f:
        f.write(envoyconf.to_yaml(llama_bootstrap()))
    log = open(os.path.join(RUN_DIR, "envoy.log"), "wb")
    e = subprocess.Popen(["sh", "-c", '"$@" & wait', "sh", kvstack.ENVOY, "-c", conf, "--concurrency", "2"],
                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pids.append(e.pid)
    with open(os.path.join(RUN_DIR, "pids"), "w") as f:
        f.write("\n".join(map(str, pids)))
    wait_port(10000, proc=e)
    print("kvroute stack running on llama.cpp: Envoy http://127.0.0.1:10000 (admin http://127.0.0.1:9901)")
    print(f"  llama-server workers 127.0.0.1:{LLAMA_PORTS[0]}-{LLAMA_PORTS[-1]}; Envoy config and logs in build/run/")
    print("  try: curl -si localhost:10000/v1/chat/completions "
          "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":8}'")
    print("  stop with: make stop")
    return 0


def vllm_bootstrap(engines: list, precise: bool) -> dict:
    """`make run ENGINE=vllm`: Envoy with kvroute (metrics poller on; PRECISE: the relay and the
    /tokenize callout) in front of the vLLM workers, from scripts/envoyconf.py."""
    fleet = [envoyconf.Upstream(w.name, "127.0.0.1", w.port, "both", kv_blocks=w.kv_blocks) for w in engines]
    site = envoyconf.Site(wasm=os.path.join(ROOT, "build", "kvroute.wasm"), **kvstack.VLLM_SITE,
                          relay=("127.0.0.1", RELAY_PORTS[0]) if precise else None)
    plugin = {"workers": envoyconf.plugin_workers(fleet),
              **kvstack.vllm_kvroute(poll_ms=500, tokenize=precise), "debug_headers": False}
    if precise:
        plugin["relay"] = {"cluster": envoyconf.RELAY_CLUSTER}
    return envoyconf.bootstrap(site, fleet, plugin)


def run_vllm() -> int:
    stop(quiet=True)
    if kvstack.vllm_paths() is None:
        print("vLLM is not installed: make vllm (scripts/vllm_install.sh)", file=sys.stderr)
        return 1
    os.makedirs(RUN_DIR, exist_ok=True)
    engines = vllm_engines(VLLM_PORTS, events=PRECISE)
    pids = []
    print("starting 3 vLLM engines (about a minute) ...", flush=True)
    kvstack.start_vllm(engines, RUN_DIR)

    def started(pid: int) -> None:
        # Written at each step: a later step that fails leaves `make stop` what to stop.
        pids.append(pid)
        with open(os.path.join(RUN_DIR, "pids"), "w") as f:
            f.write("\n".join(map(str, pids)))

    for w in engines:
        started(w.proc.pid)
    envoy_env: dict = {}
    if PRECISE:
        envoy_env, relay_auth, _ = run_secrets()
        relay = kvstack.vllm_relay(engines, port=RELAY_PORTS[0], metrics_port=RELAY_PORTS[1])
        started(spawn(relay.command() + relay_auth[:2], "relay.log").pid)
    conf = os.path.join(RUN_DIR, "envoy-vllm.yaml")
    with open(conf, "w") as f:
        f.write(envoyconf.to_yaml(vllm_bootstrap(engines, PRECISE)))
    e = spawn([kvstack.ENVOY, "-c", conf, "--concurrency", "2"], "envoy.log", env=envoy_env)
    started(e.pid)
    wait_port(10000, proc=e)
    print("kvroute stack running on vLLM: Envoy http://127.0.0.1:10000 (admin http://127.0.0.1:9901)")
    print(f"  vLLM workers 127.0.0.1:{VLLM_PORTS[0]}-{VLLM_PORTS[-1]} ({VLLM_KV_BLOCKS} KV blocks of "
          f"{kvstack.VLLM_BLOCK} tokens each, model {kvstack.VLLM_MODEL}); Envoy config and logs in build/run/")
    if PRECISE:
        print("  authentication: the relay token is in build/run/relay-token (Envoy has it in KVROUTE_RELAY_TOKEN)")
        print(f"  precise mode: KV events on tcp://127.0.0.1:{VLLM_EVENT_PORT}-{VLLM_EVENT_PORT + len(engines) - 1} "
              f"(replay {REPLAY_OFFSET} above), kvroute-relay gRPC 127.0.0.1:{RELAY_PORTS[0]}, metrics "
              f"http://127.0.0.1:{RELAY_PORTS[1]}/metrics; prompts tokenized by the engines' /tokenize")
    print("  try: curl -si localhost:10000/v1/chat/completions "
          f"-d '{{\"model\":\"{kvstack.VLLM_MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],"
          "\"max_tokens\":8}'")
    print("  stop with: make stop")
    return 0


REPLICAS = int(os.environ.get("REPLICAS") or 1)
NATS_PORT = 4222


def replica_bootstrap(i: int) -> dict:
    """Gateway `i` of `make run REPLICAS=n`: Envoy on 10000+10i (admin 9901+10i) with its own
    kvroute-relay on 7000+10i, the plugin configured as envoy/demo-precise.yaml's."""
    site = envoyconf.Site(listen=("127.0.0.1", 10000 + 10 * i), admin=("127.0.0.1", 9901 + 10 * i),
                          relay=("127.0.0.1", RELAY_PORTS[0] + 10 * i),
                          wasm=os.path.join(ROOT, "build", "kvroute.wasm"))
    plugin = envoyconf.shipped()["envoy/demo-precise.yaml"][2]
    return envoyconf.bootstrap(site, DEMO_WORKERS, plugin)


def spawn(cmd: list[str], log_name: str, env: dict | None = None) -> subprocess.Popen:
    log = open(os.path.join(RUN_DIR, log_name), "wb")
    # Envoy exits with SIGTERM when the process that started it exits, so a shell that waits
    # for it stays behind as its parent; `stop` signals the whole process group.
    return subprocess.Popen(["sh", "-c", '"$@" & wait', "sh", *cmd], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=None if env is None else {**os.environ, **env})


def run_secrets() -> tuple[dict, list[str], list[str]]:
    """Fresh credentials for this run, in build/run/ (owner-only files): Envoy's environment
    (the relay token for the filter), the relay's auth flags, and nats-server's flags (a user
    for the relays, allowed on the gateways' subjects only)."""
    token = kvstack.new_secret()
    token_file = kvstack.write_secret(os.path.join(RUN_DIR, "relay-token"), token + "\n")
    password = kvstack.new_secret()
    password_file = kvstack.write_secret(os.path.join(RUN_DIR, "nats-password"), password + "\n")
    conf = kvstack.write_secret(os.path.join(RUN_DIR, "nats.conf"), kvstack.nats_conf(password))
    relay = ["--token-file", token_file, "--nats-user", kvstack.NATS_USER, "--nats-password-file", password_file]
    return {kvstack.RELAY_TOKEN_ENV: token}, relay, ["-c", conf]


def run() -> int:
    if ENGINE == "llama":
        return run_llama()
    if ENGINE == "vllm":
        return run_vllm()
    stop(quiet=True)
    os.makedirs(RUN_DIR, exist_ok=True)
    procs = [spawn(worker_command(w, DEMO_WORKERS), f"{w.name}.log") for w in DEMO_WORKERS]
    envoys = []
    envoy_env, relay_auth, nats_auth = run_secrets()
    if REPLICAS > 1:
        procs.append(spawn([kvstack.NATS_SERVER, "-a", "127.0.0.1", "-p", str(NATS_PORT), *nats_auth], "nats.log"))
        wait_port(NATS_PORT, proc=procs[-1])
        for i in range(REPLICAS):
            cmd = relay_command(DEMO_WORKERS if PRECISE else [], port_offset=10 * i)
            procs.append(spawn(cmd + relay_auth + ["--nats", f"nats://127.0.0.1:{NATS_PORT}"], f"relay-{i}.log"))
            conf = os.path.join(RUN_DIR, f"envoy-{i}.yaml")
            with open(conf, "w") as f:
                f.write(envoyconf.to_yaml(replica_bootstrap(i)))
            envoys.append(spawn([kvstack.ENVOY, "-c", conf, "--concurrency", "2", "--base-id", str(10 + i)],
                                f"envoy-{i}.log", env=envoy_env))
    else:
        if PRECISE:
            procs.append(spawn(relay_command(DEMO_WORKERS) + relay_auth[:2], "relay.log"))
        conf = os.path.join(ROOT, "envoy", "demo-precise.yaml" if PRECISE else "demo.yaml")
        envoys.append(spawn([kvstack.ENVOY, "-c", conf, "--concurrency", "2"], "envoy.log", env=envoy_env))
    with open(os.path.join(RUN_DIR, "pids"), "w") as f:
        f.write("\n".join(str(p.pid) for p in procs + envoys))
    for w in DEMO_WORKERS:
        wait_port(w.port)
    for i, e in enumerate(envoys):
        wait_port(10000 + 10 * i, proc=e)
    for i in range(REPLICAS):
        print(f"kvroute gateway {i}: Envoy http://127.0.0.1:{10000 + 10 * i} (admin http://127.0.0.1:{9901 + 10 * i})")
    print("  decode workers 127.0.0.1:8001-8004, prefill pool 127.0.0.1:8101-8102; logs in build/run/")
    if REPLICAS > 1:
        print(f"  gateways share decisions: nats-server 127.0.0.1:{NATS_PORT}, one kvroute-relay each on "
              + ", ".join(f"127.0.0.1:{RELAY_PORTS[0] + 10 * i}" for i in range(REPLICAS)))
    if REPLICAS > 1 or PRECISE:
        print("  authentication: the relay token is in build/run/relay-token (Envoy has it in KVROUTE_RELAY_TOKEN),"
              f" NATS user {kvstack.NATS_USER} with build/run/nats-password (build/run/nats.conf)")
    if PRECISE:
        print(f"  precise mode: KV events on tcp://127.0.0.1:5557-5562, kvroute-relay gRPC 127.0.0.1:{RELAY_PORTS[0]}, "
              f"metrics http://127.0.0.1:{RELAY_PORTS[1]}/metrics (text prompts are tokenized by the engines first)")
    print("  try: curl -si localhost:10000/v1/completions "
          f"-d '{{\"model\":\"{MOCK_MODEL}\",\"prompt\":\"hello\",\"max_tokens\":8}}'")
    print("  stop with: make stop")
    return 0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose members are all zombies (their parent gone) still answers signal 0.
    return any(state != "Z" for state in group_states(pgid))


def group_states(pgid: int) -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(fields[0])
    return out


def stop(quiet: bool = False) -> int:
    path = os.path.join(RUN_DIR, "pids")
    if not os.path.exists(path):
        if not quiet:
            print("nothing running")
        return 0
    groups = []
    for pid in open(path).read().split():
        try:
            # Each process leads its own group (start_new_session): signal the group.
            os.killpg(int(pid), signal.SIGTERM)
            groups.append(int(pid))
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    # vLLM's engine processes take a few seconds to shut down; what is left after 20 s is killed.
    deadline = time.time() + 20
    while groups and time.time() < deadline:
        groups = [g for g in groups if group_alive(g)]
        time.sleep(0.2)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.remove(path)
    if not quiet:
        print("stopped")
    return 0


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "demo"
    sys.exit({"demo": demo, "run": run, "stop": stop}[cmd]())
