"""The real upstream's server is stopped whole (tests/integration/server_tree.py): its own
process, an engine it started that ignores SIGTERM (only the escalation to SIGKILL ends it), and
a daemon that left its process group and lost its parent. Stopped before the session's check
that no test left a process running, which must still report a child a test did leave; and
stopped when the runner itself is SIGKILLed.

The server here is a stand-in (a Python HTTP server that starts those two), so that this runs
in ``make test``; ``make test-vllm`` and ``make test-llamacpp`` run the same runner in front of
the real ones.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests import processes
from tests.integration.run_real_upstream import free_port
from tests.integration.server_tree import KILL_WAIT, ServerTree

ROOT = Path(__file__).parents[2]
GRACE = 1.0

STAND_IN_SERVER = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys

    port, pids_path = int(sys.argv[1]), sys.argv[2]
    engine = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print(flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )
    engine.stdout.readline()  # SIGTERM is ignored from here on
    # A daemon: a session of its own, and its parent gone at once.
    daemon = int(subprocess.check_output([
        sys.executable, "-c",
        "import subprocess; print(subprocess.Popen(['sleep', '600'], start_new_session=True,"
        " stdout=subprocess.DEVNULL).pid)",
    ]))
    with open(pids_path + ".part", "w") as out:
        json.dump({"server": os.getpid(), "engine": engine.pid, "daemon": daemon}, out)
    os.replace(pids_path + ".part", pids_path)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)

# An owner of a tree that waits to be killed.
OWNER = textwrap.dedent(
    """
    import os, sys, time
    from tests.integration.server_tree import ServerTree

    with open(sys.argv[1], "wb") as log:
        ServerTree(sys.argv[3:], log=log, env=dict(os.environ), grace=float(sys.argv[2]))
        time.sleep(600)
    """
)

# The real-upstream runner, in front of the stand-in, running tests/integration/tree_session.py.
RUNNER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from tests.integration.run_real_upstream import free_port, run_with_server

    folder, server, *pytest_args = sys.argv[1:]
    port = free_port()
    sys.exit(run_with_server(
        "stand-in",
        [sys.executable, server, str(port), str(Path(folder) / "pids.json")],
        log_path=Path(folder) / "server.log",
        env=dict(os.environ),
        url=f"http://127.0.0.1:{port}",
        ready_path="/health",
        env_prefix="SLUICE_TREE",
        pytest_args=["-q", "-p", "no:cacheprovider", "tests/integration/tree_session.py",
                     *pytest_args],
        plugins=[],
        grace=float(os.environ["TREE_GRACE"]),
    ))
    """
)


def stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "server.py"
    script.write_text(STAND_IN_SERVER)
    return script


def tree_pids(pids_path: Path, within: float = 60.0) -> dict[str, int]:
    """The stand-in's processes, once it has written them down."""
    deadline = time.monotonic() + within
    while not pids_path.exists():
        assert time.monotonic() < deadline, "the stand-in server never started"
        time.sleep(0.05)
    pids: dict[str, int] = json.loads(pids_path.read_text())
    return pids


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TREE_GRACE": str(GRACE)}


def test_stop_ends_the_server_its_engine_and_a_daemon_that_left(tmp_path: Path) -> None:
    pids_path = tmp_path / "pids.json"
    argv = [sys.executable, str(stand_in(tmp_path)), str(free_port()), str(pids_path)]
    with (tmp_path / "server.log").open("wb") as log:
        tree = ServerTree(argv, log=log, env=dict(os.environ), grace=GRACE)
        try:
            pids = tree_pids(pids_path)
            assert all(processes.is_alive(pid) for pid in pids.values())
            started = time.monotonic()
            forced = tree.stop()
            took = time.monotonic() - started
        finally:
            tree.stop()
    assert forced == []  # the keeper ended it, not the owner's last resort
    assert [name for name, pid in pids.items() if processes.is_alive(pid)] == []
    # The engine took SIGTERM and stayed: the keeper waited out the grace, then SIGKILLed it.
    assert GRACE <= took < GRACE + KILL_WAIT
    written = (tmp_path / "server.log").read_text()
    assert re.search(rf"\b{pids['engine']}: ", written.split("killed:", 1)[1])
    assert tree.poll() == 128 + signal.SIGTERM  # the server itself left on SIGTERM


def test_the_tree_ends_when_its_owner_is_killed(tmp_path: Path) -> None:
    pids_path = tmp_path / "pids.json"
    server = [sys.executable, str(stand_in(tmp_path)), str(free_port()), str(pids_path)]
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "server.log"), str(GRACE), *server],
        env=environment(),
    )
    try:
        pids = tree_pids(pids_path)
        keeper = processes.children(owner.pid)
        assert len(keeper) == 1
    finally:
        owner.kill()
        owner.wait()
    # The keeper (re-parented to this session, a subreaper) reads EOF and ends the tree.
    left = processes.wait_gone([*keeper, *pids.values()], GRACE + KILL_WAIT)
    assert left == [], [processes.cmdline(pid) for pid in left]


def run_the_runner(
    tmp_path: Path, *pytest_args: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path), str(stand_in(tmp_path)), *pytest_args],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result, tree_pids(tmp_path / "pids.json", within=0)


def test_the_runner_ends_its_server_before_the_leak_check(tmp_path: Path) -> None:
    result, pids = run_the_runner(tmp_path, "-k", "test_the_server_answers")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "processes left behind" not in result.stdout
    assert "stand-in stopped in" in result.stdout
    assert [name for name, pid in pids.items() if processes.is_alive(pid)] == []


def test_a_child_a_test_leaves_is_still_reported(tmp_path: Path) -> None:
    result, pids = run_the_runner(tmp_path, "-k", "test_leaves_a_child_running")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    report = result.stdout.split("processes left behind", 1)[1]
    named = dict(re.findall(r"^(\d+): (.*)$", report, re.MULTILINE))
    assert list(named.values()) == ["sleep 600"], report
    # The runner's own server is not among them: it was ended before the check.
    assert [name for name, pid in pids.items() if processes.is_alive(pid)] == []
