"""Supervision, on a real ``sluice serve --workers 2``: workers never outlive their supervisor,
a worker that dies is replaced while the port goes on answering, and SIGHUP stops nothing.
Also the test session's own check that no test leaves a process behind (tests/processes.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import trio

from proxy.server.workers import _MIN_UPTIME
from tests import processes
from tests.support import chat_body, run_python, start_sluice, stop

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the process tree from /proc (Linux)"
)

CHAT = "/v1/chat/completions"


def workers_config(tmp_path: Path) -> Path:
    config = tmp_path / "workers.toml"
    config.write_text(
        "[server]\nport = 0\n[fake_upstream]\nenabled = true\nttft = 0\ninterval = 0.05\n"
        'tokens = 3\n[models.fake-model]\nupstreams = ["fake:"]\n'
    )
    return config


async def worker_pids(url: str, count: int = 2) -> set[int]:
    """The pids of ``count`` workers that answer on ``url`` (fresh connections, until the
    kernel has handed one to each)."""
    pids: set[int] = set()
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        while len(pids) < count:
            health = await client.get(url + "/healthz", headers={"Connection": "close"})
            pids.add(health.json()["pid"])
    return pids


def port_is_free(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


async def test_a_killed_supervisors_workers_are_gone_within_3_s(tmp_path: Path) -> None:
    with trio.fail_after(60):
        process, url = await start_sluice(workers_config(tmp_path), "--workers", "2")
        try:
            workers = await worker_pids(url)
            below = processes.descendants(process.pid)
            assert workers <= set(below)  # and the multiprocessing resource tracker
            async with trio.open_nursery() as nursery:
                streaming = trio.Event()

                async def stream_for_ever() -> None:
                    # In flight when the supervisor goes: its drain (10 s by default) must not
                    # hold the worker past the bound.
                    body = chat_body(fake={"tokens": 100_000})
                    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
                        try:
                            async with client.stream("POST", url + CHAT, json=body) as response:
                                async for _ in response.aiter_bytes():
                                    streaming.set()
                        except httpx.HTTPError:
                            pass  # cut when its worker goes

                nursery.start_soon(stream_for_ever)
                await streaming.wait()
                process.kill()
                killed_at = trio.current_time()
                await process.wait()
                left = await processes.trio_wait_gone(below, 3.0)
                gone_after = trio.current_time() - killed_at
                nursery.cancel_scope.cancel()
            assert left == [], [processes.cmdline(pid) for pid in left]
            assert gone_after < 3.0
            # Nothing holds the listening socket any more: a new supervisor could bind it.
            assert port_is_free(url)
        finally:
            await stop(process)


async def test_a_killed_worker_is_replaced_and_the_port_keeps_answering(tmp_path: Path) -> None:
    with trio.fail_after(90):
        process, url = await start_sluice(workers_config(tmp_path), "--workers", "2")
        started = trio.current_time()
        try:
            workers = await worker_pids(url)
            # One that dies sooner is taken for a worker that cannot start (all stop).
            await trio.sleep_until(started + _MIN_UPTIME + 0.5)
            killed = min(workers)
            os.kill(killed, signal.SIGKILL)
            seen: set[int] = set()
            answered = 0
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                # Every fresh connection is answered, by the survivor until the replacement
                # serves too.
                while not seen - workers:
                    health = await client.get(url + "/healthz", headers={"Connection": "close"})
                    assert health.status_code == 200
                    seen.add(health.json()["pid"])
                    answered += 1
                    await trio.sleep(0.02)
                response = await client.post(url + CHAT, json=chat_body(stream=False))
                assert response.status_code == 200
            assert not processes.is_alive(killed)
            now = await worker_pids(url)
            assert killed not in now and len(now - workers) == 1
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            await stop(process)


async def test_sighup_stops_neither_the_supervisor_nor_its_workers(tmp_path: Path) -> None:
    with trio.fail_after(60):
        process, url = await start_sluice(workers_config(tmp_path), "--workers", "2")
        try:
            workers = await worker_pids(url)
            process.send_signal(signal.SIGHUP)
            await trio.sleep(1.0)  # the supervisor's loop would have seen a death by now
            assert process.returncode is None
            assert all(processes.is_alive(pid) for pid in workers)
            assert await worker_pids(url) == workers
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            await stop(process)


ORPHANING_SESSION = textwrap.dedent(
    """
    import json, subprocess, sys
    from tests import processes

    assert processes.become_subreaper()
    # A double fork: the shell exits at once, its sleep is orphaned (and left to us).
    sleeper = int(subprocess.check_output(["sh", "-c", "sleep 60 >/dev/null & echo $!"]))
    assert processes.is_alive(sleeper)
    left = processes.kill_left_behind()
    print(json.dumps({"sleeper": sleeper, "left": left, "alive": processes.is_alive(sleeper)}))
    """
)


def test_the_session_check_finds_and_kills_an_orphan() -> None:
    # In a session of its own (a Python process as subreaper), so that it looks at its tree,
    # not at this one's.
    result = subprocess.run(
        [sys.executable, "-c", ORPHANING_SESSION],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    report = json.loads(result.stdout)
    assert report["left"] == [f"{report['sleeper']}: sleep 60"]
    assert report["alive"] is False
    assert not processes.is_alive(report["sleeper"])


# A worker's watch without PR_SET_PDEATHSIG, on its own: this test holds the pipe's write end.
# The stand-in server takes every SIGTERM and never stops, so only the hard bound ends it.
WATCHING_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from multiprocessing.connection import Connection
    import trio
    from proxy.server.supervision import SupervisorLink, watching_supervisor

    link = SupervisorLink(os.getppid(), Connection(int(sys.argv[1]), writable=False))

    async def main():
        async with watching_supervisor(link, parent_death_signal=False):
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                print("serving", flush=True)
                async for signum in signals:
                    print(f"{time.monotonic():.3f} SIGTERM", flush=True)

    trio.run(main)
    """
)


async def test_without_the_parent_death_signal_the_pipe_drains_then_ends_a_worker() -> None:
    reader, writer = os.pipe()
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", WATCHING_WORKER, str(reader)],
            stdout=subprocess.PIPE,
            pass_fds=(reader,),
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
    finally:
        os.close(reader)
    assert process.stdout is not None
    with trio.fail_after(30):
        received = b""
        while b"serving" not in received:
            received += await process.stdout.receive_some()
        os.close(writer)  # the supervisor has gone
        closed_at = trio.current_time()
        await process.wait()
        ended_after = trio.current_time() - closed_at
        received += b"".join([chunk async for chunk in process.stdout])
        await process.stdout.aclose()
    signals = [line for line in received.decode().splitlines() if line.endswith("SIGTERM")]
    # The first starts the drain, the second (1 s on) cancels what is left; then the alarm.
    assert len(signals) == 2
    first, second = (float(line.split()[0]) for line in signals)
    assert 0.9 < second - first < 1.5
    assert process.returncode == -signal.SIGALRM
    assert ended_after < 2.5


def test_a_worker_whose_supervisor_had_already_gone_exits_at_once() -> None:
    script = (
        "import os\n"
        "from multiprocessing.connection import Connection\n"
        "from proxy.server.supervision import SupervisorLink, arm_parent_death_signal\n"
        "r, w = os.pipe()\n"
        "arm_parent_death_signal(SupervisorLink(os.getppid() + 1, Connection(r)))\n"
        "print('still running')\n"
    )
    result = run_python(script, timeout=30)
    assert result.returncode == 0
    assert "still running" not in result.stdout
