"""The leak guard itself (scripts/leftovers.py, tests/e2e/conftest.py, `make test`'s last
step): a project process a run started and left running is found, even re-parented, and
the check fails naming it; processes of other runs are not judged."""

import os
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import leftovers  # noqa: E402

ROOT = leftovers.ROOT
PY = os.path.join(ROOT, ".venv", "bin", "python")
CHECK = [sys.executable, os.path.join(ROOT, "scripts", "leftovers.py")]


def orphan(mark: str) -> int:
    """A project program (the venv's python) that outlives the shell that started it, with
    `mark` as this run's KVROUTE_TEST_RUN; returns its pid."""
    env = {**os.environ, leftovers.MARK: mark}
    out = subprocess.run(["sh", "-c", f"'{PY}' -c 'import time; time.sleep(60)' >/dev/null 2>&1 & echo $!"],
                         env=env, capture_output=True, text=True, check=True, start_new_session=True)
    return int(out.stdout.strip())


def test_a_surviving_process_fails_the_check_and_others_runs_do_not():
    mine, other = f"t-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex}"
    pid = orphan(mine)
    stranger = orphan(other)
    try:
        env = {**os.environ, leftovers.MARK: mine}
        r = subprocess.run(CHECK, env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, r
        assert f"  {pid} " in r.stderr and "time.sleep(60)" in r.stderr, r.stderr
        # The other run's process carries another mark: not this run's leak.
        assert f"  {stranger} " not in r.stderr, r.stderr
        # Re-parented to init (its shell is gone): still found, by the environment.
        assert leftovers.marked(mine).keys() == {pid}
        r = subprocess.run([*CHECK, "--kill"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "killed" in r.stderr, r
        deadline = time.time() + 5
        while leftovers.marked(mine) and time.time() < deadline:
            time.sleep(0.05)
        r = subprocess.run(CHECK, env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r
    finally:
        leftovers.kill([pid, stranger])


def test_the_check_refuses_to_run_unmarked():
    env = {k: v for k, v in os.environ.items() if k != leftovers.MARK}
    r = subprocess.run(CHECK, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and leftovers.MARK in r.stderr, r


LEAKY_MODULE = f'''
import subprocess

def test_starts_a_worker_and_forgets_it():
    subprocess.Popen(["{PY}", "-c", "import time; time.sleep(60)"])
'''

GUARD = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("e2e_guard", "{os.path.join(os.path.dirname(__file__), "conftest.py")}")
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)
no_process_outlives_its_module = guard.no_process_outlives_its_module
'''


def test_a_module_that_leaks_a_process_fails(tmp_path):
    (tmp_path / "conftest.py").write_text(GUARD)
    (tmp_path / "test_leaky.py").write_text(LEAKY_MODULE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 passed, 1 error" in out and "left 1 process(es) running (now killed)" in out, out
    assert "time.sleep(60)" in out, out
