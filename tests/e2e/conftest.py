"""Every e2e module must stop what it starts: Envoy, workers, relays, nats-server, engines.

The session marks itself in the environment (scripts/leftovers.py), so every process a test
starts, however indirectly, carries the mark. After each module, a project process with the
mark that was not running before the module is a leak: the module fails (an error in its
last teardown) naming it, and the process is killed so the next module starts clean.
Processes of concurrent runs, or of a `make run` stack, carry no mark of this session and
are never judged.

One fleet of real vLLM engines serves several modules (`vllm_engines`: an engine starts in
about a minute here, so test_vllm.py and test_vllm_lora.py share three, LoRA enabled). Its
processes carry a mark of their own, so the per-module check leaves them alone; the modules
that use it run one after the other, and the fleet stops, and is checked the same way, right
after the last test that uses it. Modules marked `vllm` are skipped when vLLM is not
installed, except under `make test` (KVROUTE_REQUIRE_VLLM=1), which installs it first.
"""

import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import leftovers  # noqa: E402
from kvstack import VllmWorker, start_vllm, vllm_fleet, vllm_lora_args, vllm_paths  # noqa: E402

# Set at import, before any test module starts a process: children inherit it. Under
# `make test` they also keep that run's own mark, which the Makefile checks after all suites.
RUN = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ[leftovers.PYTEST_MARK] = RUN
SHARED_RUN = RUN + "-vllm-engines"

REQUIRE_VLLM = os.environ.get("KVROUTE_REQUIRE_VLLM", "") not in ("", "0")

# The shared engines: enough KV blocks of 32 tokens for test_vllm.py's eviction to be tested
# (96 each), KV events on, and two rank-8 adapters (name: seed of its weights) for
# test_vllm_lora.py.
VLLM_ENGINES = 3
VLLM_KV_BLOCKS = 96
LORA_ADAPTERS = {"sql": 1, "chat": 2}
LORA_MAX = 2


def check_no_survivors(mark: str, what: str, ignore: frozenset | set = frozenset()) -> None:
    left = leftovers.survivors(mark, leftovers.PYTEST_MARK, ignore=ignore)
    if left:
        leftovers.kill(left)
        listed = "\n".join(f"  {pid} {cmd[:300]}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"{what} left {len(left)} process(es) running (now killed):\n{listed}", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_its_module(request):
    before = set(leftovers.marked(RUN, leftovers.PYTEST_MARK))
    yield
    check_no_survivors(RUN, request.module.__name__, ignore=before)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs real vLLM (scripts/vllm_install.sh, make vllm)")


def pytest_collection_modifyitems(config, items):
    if vllm_paths() is None and not REQUIRE_VLLM:
        skip = pytest.mark.skip(reason="vLLM not installed (scripts/vllm_install.sh, make vllm)")
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip)
    # The shared engines' users, together where the first of them stands, in their order.
    users = [i for i in items if "vllm_engines" in i.fixturenames]
    if users:
        first = items.index(users[0])
        ids = {id(i) for i in users}
        rest = [i for i in items if id(i) not in ids]
        items[:] = rest[:first] + users + rest[first:]
        _shared.last_user = users[-1].nodeid


@dataclass
class VllmEngines:
    workers: list[VllmWorker]
    dir: str
    adapters: list[str]
    max_loras: int

    def revive(self) -> None:
        """Starts again the engines a test killed (or that died)."""
        dead = [w for w in self.workers if not w.running()]
        if dead:
            start_vllm(dead, self.dir)


class _Shared:
    engines: VllmEngines | None = None
    last_user: str = ""

    def stop(self) -> None:
        if self.engines is None:
            return
        workers, self.engines = self.engines.workers, None
        for w in workers:
            w.stop()
        # vLLM's engine core is a child of its API server: nothing of any engine may remain.
        for w in workers:
            assert w.proc is None or w.proc.poll() is not None
        check_no_survivors(SHARED_RUN, "the shared vLLM engines")


_shared = _Shared()


@pytest.fixture(scope="session")
def vllm_engines():
    """Three vLLM CPU engines (one core each, round-robin over the machine's cores) with KV
    events and LoRA, started once for every module that uses them."""
    if vllm_paths() is None:
        pytest.fail("vLLM is not installed: make vllm (scripts/vllm_install.sh)")
    d = tempfile.mkdtemp(prefix="kvroute-vllm-")
    args = vllm_lora_args(d, LORA_ADAPTERS, LORA_MAX)
    workers = vllm_fleet(VLLM_ENGINES, kv_blocks=VLLM_KV_BLOCKS, kv_events=True)
    for w in workers:
        w.args = list(args)
        w.extra_env = {leftovers.PYTEST_MARK: SHARED_RUN}
    t0 = time.time()
    start_vllm(workers, d)
    print(f"\n{len(workers)} vLLM engines with LoRA healthy in {time.time() - t0:.0f} s ("
          + ", ".join(f"{w.name} {w.started_s:.0f} s" for w in workers) + f"); logs in {d}")
    _shared.engines = VllmEngines(workers, d, list(LORA_ADAPTERS), LORA_MAX)
    try:
        yield _shared.engines
    finally:
        _shared.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    res = yield
    if item.nodeid == _shared.last_user:
        _shared.stop()
    return res
