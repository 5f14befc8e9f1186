"""Every process the suite starts runs in its own process group and is stopped by pid, when its
run ends, fails, or on exit, SIGTERM or Ctrl-C; plus the small HTTP client and the readiness
loop the stack uses."""

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvstack import free_port  # noqa: F401  (one port never handed out twice, as in the tests' stacks)


def proc_cpu_s(procs):
    """User + system CPU seconds of these processes so far, all their threads (Linux /proc;
    0 for a process that is gone or where /proc is missing)."""
    total = 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


class Procs:
    """Every process this suite starts, each in its own process group, stopped by pid."""

    live = []

    @classmethod
    def start(cls, argv, logpath, env=None):
        """env: variables added to this environment's."""
        f = open(logpath, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=dict(os.environ, **env) if env else None)
        f.close()
        cls.live.append(p)
        return p

    @classmethod
    def stop(cls, procs):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
            if p in cls.live:
                cls.live.remove(p)

    @classmethod
    def stop_all(cls):
        cls.stop(list(reversed(cls.live)))


def _on_signal(sig, _frame):
    Procs.stop_all()
    sys.exit(128 + sig)


# Whatever is still running when the suite exits or is stopped.
atexit.register(Procs.stop_all)
signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGINT, _on_signal)


def http(method, url, body=None, timeout=5.0, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_until(fn, timeout, what, procs=()):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: process exited with {p.returncode}")
        try:
            ok, last = fn()
            if ok:
                return last
        except Exception as e:  # connection refused while starting
            last = str(e)
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f} s ({last})")
