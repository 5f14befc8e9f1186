"""Every e2e module must stop what it starts: Envoy, workers, relays, nats-server, engines.

The session marks itself in the environment (scripts/leftovers.py), so every process a test
starts, however indirectly, carries the mark. After each module, a project process with the
mark that was not running before the module is a leak: the module fails (an error in its
last teardown) naming it, and the process is killed so the next module starts clean.
Processes of concurrent runs, or of a `make run` stack, carry no mark of this session and
are never judged.
"""

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import leftovers  # noqa: E402

# Set at import, before any test module starts a process: children inherit it. Under
# `make test` they also keep that run's own mark, which the Makefile checks after all suites.
RUN = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ[leftovers.PYTEST_MARK] = RUN


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_its_module(request):
    before = set(leftovers.marked(RUN, leftovers.PYTEST_MARK))
    yield
    left = leftovers.survivors(RUN, leftovers.PYTEST_MARK, ignore=before)
    if left:
        leftovers.kill(left)
        listed = "\n".join(f"  {pid} {cmd[:300]}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"{request.module.__name__} left {len(left)} process(es) running (now killed):\n{listed}",
                    pytrace=False)
