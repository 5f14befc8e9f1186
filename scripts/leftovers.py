"""Processes a test run started and left running.

Every process inherits its parent's environment, so a run marks itself with an environment
variable (`MARK`, the value unique to the run) and afterwards looks for running processes
that still carry the mark: exactly what this run started, directly or not, even after their
parent exited and they were re-parented, and nothing a concurrent run or a `make run` stack
started. Only project programs count (their executable or argv[0] under this checkout:
Envoy and nats-server in .venv, target/ binaries, llama-server and vLLM under build/);
the shells and `make` of the run itself carry the mark too and are not leaks.

    python3 scripts/leftovers.py [--kill]   (MARK from the environment; exit 1 listing survivors)

Standard library only. Linux /proc.
"""

from __future__ import annotations

import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "KVROUTE_TEST_RUN"
# The e2e session's own mark (tests/e2e/conftest.py), next to a `make test` run's MARK.
PYTEST_MARK = "KVROUTE_PYTEST_RUN"


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _program(pid: int) -> str | None:
    """The project path this process runs, or None when it is not a project program."""
    paths = []
    try:
        paths.append(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        argv0 = ""
    if argv0:
        cwd = ""
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            pass
        paths.append(os.path.normpath(os.path.join(cwd, argv0)) if "/" in argv0 else argv0)
    for p in paths:
        if p.startswith(ROOT + os.sep):
            return p
    return None


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def marked(value: str, var: str = MARK) -> dict[int, str]:
    """Running project processes carrying `var`=value: pid -> its command line."""
    needle = f"{var}={value}".encode()
    skip = _ancestors()
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        if needle not in _environ(pid).split(b"\0") or _state(pid) in ("Z", "X"):
            continue
        if _program(pid) is None:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return out


def survivors(value: str, var: str = MARK, grace_s: float = 3.0,
              ignore: set[int] | frozenset = frozenset()) -> dict[int, str]:
    """`marked(value, var)` minus `ignore`, after giving processes that are exiting `grace_s`."""
    deadline = time.time() + grace_s
    while True:
        left = {p: c for p, c in marked(value, var).items() if p not in ignore}
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.1)


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main() -> int:
    value = os.environ.get(MARK)
    if not value:
        print(f"leftovers: {MARK} is not set: nothing marks this run's processes", file=sys.stderr)
        return 2
    left = survivors(value)
    if not left:
        print("leftovers: no process of this run survives it")
        return 0
    print(f"leftovers: {len(left)} process(es) started by this run still run:", file=sys.stderr)
    for pid, cmd in sorted(left.items()):
        print(f"  {pid} {cmd[:300]}", file=sys.stderr)
    if "--kill" in sys.argv[1:]:
        kill(left)
        print("leftovers: killed them", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
