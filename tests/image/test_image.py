"""The container images that `make image` built (Containerfile), run as a runtime runs them and
checked from this machine: `make test-image` (opt-in: it needs buildah and the built images).

Each test runs the image's ``sluice`` in a working container under ``buildah run --isolation
chroot``: the image's filesystem, user, working directory and environment, and this machine's
network (chroot isolation has no network namespace), so the fake upstream runs here, in the
test, and sees what the Sluice in the image does to its connections. ``buildah run`` does not
apply the image's ENTRYPOINT, so the tests run the one the image declares. The signal a runtime
sends on stop (STOPSIGNAL) goes to the server process itself, as to a container's PID 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests import containerfile, processes
from tests.support import chat_body, sse_payloads, start_fake

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
with (ROOT / "pyproject.toml").open("rb") as _file:
    VERSION = tomllib.load(_file)["project"]["version"]
PROXY_IMAGE = f"localhost/sluice:{VERSION}"
LOCAL_IMAGE = f"localhost/sluice:{VERSION}-local"
CHAT = "/v1/chat/completions"
# Where the tests mount their config in the container (read-only), as Kubernetes does.
CONFIG_DIR = "/etc/sluice"


def buildah(*args: str, timeout: float = 120) -> str:
    if shutil.which("buildah") is None:
        pytest.fail("buildah is not installed: `make image` installs it and builds the images")
    result = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stderr.strip()}"
    return result.stdout


def image_config(image: str) -> dict[str, Any]:
    """The image's OCI config (user, environment, entry point...), as a runtime reads it."""
    if subprocess.run(
        ["buildah", "inspect", "--type", "image", image], capture_output=True
    ).returncode:
        pytest.fail(f"no image {image} in buildah's storage: run `make image` first")
    config: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"][
        "config"
    ]
    return config


@dataclass
class Container:
    name: str
    image: str
    config: dict[str, Any]

    def run(self, *argv: str, volume: Path | None = None) -> list[str]:
        """``buildah run`` of ``argv``, as the image's user, ``volume`` mounted read-only on
        CONFIG_DIR."""
        options = ["--isolation", "chroot"]
        if volume is not None:
            options += ["--volume", f"{volume}:{CONFIG_DIR}:ro"]
        return ["buildah", "run", *options, self.name, "--", *argv]

    def command(self, *args: str, volume: Path | None = None) -> list[str]:
        """The image's entry point with ``args``."""
        return self.run(*self.config["Entrypoint"], *args, volume=volume)


def working_container(image: str) -> Iterator[Container]:
    config = image_config(image)
    name = buildah("from", "--pull-never", "--quiet", image).strip()
    try:
        yield Container(name, image, config)
    finally:
        buildah("rm", name)


@pytest.fixture
def proxy_container() -> Iterator[Container]:
    yield from working_container(PROXY_IMAGE)


@pytest.fixture
def local_container() -> Iterator[Container]:
    yield from working_container(LOCAL_IMAGE)


def config_dir(tmp_path: Path, text: str) -> Path:
    """A directory holding ``sluice.toml``, readable by the image's user (not root here)."""
    directory = tmp_path / "etc-sluice"
    directory.mkdir()
    (directory / "sluice.toml").write_text(textwrap.dedent(text))
    directory.chmod(0o755)
    (directory / "sluice.toml").chmod(0o644)
    return directory


@dataclass
class Served:
    process: trio.Process
    url: str
    server_pid: int
    output: Path

    def said(self) -> str:
        return self.output.read_text(errors="replace")


async def serve_in(
    container: Container, output: Path, *args: str, volume: Path | None = None
) -> Served:
    """``sluice serve`` in the container, once it says it serves. Its output goes to the file
    ``output``: a pipe nobody reads would block the server's log."""
    with output.open("wb") as file:
        process = await trio.lowlevel.open_process(
            container.command("serve", *args, volume=volume), stdout=file, stderr=subprocess.STDOUT
        )
    while b"sluice serving" not in (received := await trio.Path(output).read_bytes()):
        assert process.poll() is None, f"sluice serve in {container.image}: {received.decode()}"
        await trio.sleep(0.05)
    line = received.split(b"sluice serving", 1)[1].split(b"\n", 1)[0].decode()
    url = next(word for word in line.split() if word.startswith("http://"))
    # buildah run -> buildah-chroot-runtime -> buildah-chroot-exec -> the server's python.
    (server_pid,) = [
        pid
        for pid in processes.descendants(process.pid)
        if "sluice serve" in processes.cmdline(pid) and "python" in processes.cmdline(pid)
    ]
    return Served(process, url, server_pid, output)


async def serve_fake_model(
    container: Container, tmp_path: Path, upstream: str, server: str = ""
) -> Served:
    """``sluice serve`` in the container with a config of one model, "fake-model", relayed to
    ``upstream``; ``server``: more [server] lines."""
    etc = config_dir(
        tmp_path,
        f'[server]\nport = 0\n{server}[models.fake-model]\nupstreams = ["{upstream}"]\n',
    )
    return await serve_in(
        container, tmp_path / "output", "--config", f"{CONFIG_DIR}/sluice.toml", volume=etc
    )


async def finish(served: Served) -> None:
    """Kill what is left (the server first: buildah run waits for it) and reap it."""
    with trio.CancelScope(shield=True):
        below = processes.descendants(served.process.pid)
        if served.process.returncode is None:
            processes.kill_all([served.server_pid])
            with trio.move_on_after(10):
                await served.process.wait()
            if served.process.returncode is None:
                served.process.kill()
                await served.process.wait()
        left = await processes.trio_wait_gone(below, 5.0)
        processes.kill_all(left)
    assert not left, f"left running: {[processes.cmdline(pid) for pid in left]}"


def proc_ids(pid: int) -> tuple[str, str]:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return status["Uid"].split()[0], status["Gid"].split()[0]


def test_the_images_declare_what_the_containerfile_says() -> None:
    for image, target in ((PROXY_IMAGE, "proxy"), (LOCAL_IMAGE, "local")):
        config = image_config(image)
        assert config["User"] == containerfile.USER == "10001:10001"
        assert config["Entrypoint"] == containerfile.exec_form("ENTRYPOINT", target) == ["sluice"]
        assert config["Cmd"] == containerfile.exec_form("CMD", target)
        assert config["StopSignal"] == "SIGTERM"
        env = dict(entry.split("=", 1) for entry in config["Env"])
        for key in ("XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "HOME"):
            assert env[key].startswith(containerfile.CACHE_DIR), key
        assert config["Labels"]["org.opencontainers.image.version"] == VERSION


async def test_it_serves_streams_and_runs_as_its_own_user(
    proxy_container: Container, nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=20)
    with trio.fail_after(60):
        served = await serve_fake_model(proxy_container, tmp_path, fake.url)
        try:
            assert proc_ids(served.server_pid) == (containerfile.UID, containerfile.GID)
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                ready = await client.get(served.url + "/readyz")
                assert (ready.status_code, ready.json()) == (
                    200,
                    {"ready": True, "draining": False},
                )
                async with client.stream("POST", served.url + CHAT, json=chat_body()) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    text = "".join([chunk async for chunk in response.aiter_text()])
            payloads = sse_payloads(text)
            assert payloads[-1] == "[DONE]" and len(payloads) >= 20
            assert fake.recorder.last().outcome == "completed"
        finally:
            await finish(served)


async def test_a_client_leaving_mid_stream_closes_the_upstream(
    proxy_container: Container, nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=1000)
    with trio.fail_after(60):
        served = await serve_fake_model(proxy_container, tmp_path, fake.url)
        try:
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                async with client.stream("POST", served.url + CHAT, json=chat_body()) as response:
                    received = 0
                    async for _chunk in response.aiter_raw():
                        received += 1
                        if received >= 3:
                            break
                left_at = trio.current_time()
            record = fake.recorder.last(CHAT)
            with trio.fail_after(2):
                await fake.recorder.wait_for(lambda r: record.disconnected_at is not None)
            assert record.outcome == "client_disconnected"
            assert record.disconnected_at - left_at < 1.0
            assert record.tokens_sent < 1000
        finally:
            await finish(served)


async def test_sigterm_drains_the_stream_in_flight_and_exits_0(
    proxy_container: Container, nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=30)
    with trio.fail_after(60):
        served = await serve_fake_model(
            proxy_container, tmp_path, fake.url, "drain_delay = 0.5\ngraceful_timeout = 10.0\n"
        )
        try:
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                text = ""

                async def stream() -> None:
                    nonlocal text
                    async with client.stream(
                        "POST", served.url + CHAT, json=chat_body()
                    ) as response:
                        async for chunk in response.aiter_text():
                            text += chunk

                async with trio.open_nursery() as streams:
                    streams.start_soon(stream)
                    await fake.recorder.wait_for(lambda r: r.last(CHAT).tokens_sent >= 3)
                    # What the runtime does on stop: the image's STOPSIGNAL to its process.
                    os.kill(
                        served.server_pid, getattr(signal, proxy_container.config["StopSignal"])
                    )
                    await trio.sleep(0.2)
                    ready = await client.get(served.url + "/readyz")
                    assert ready.status_code == 503
                    assert ready.json() == {"ready": False, "draining": True}
            assert sse_payloads(text)[-1] == "[DONE]"
            assert fake.recorder.last(CHAT).outcome == "completed"
            # buildah run exits with the server's status.
            assert await served.process.wait() == 0
            assert "SIGTERM: draining" in served.said()
        finally:
            await finish(served)


# Walk the image as its user: every path it could write, but the cache directory and the
# standard scratch directories (sticky, world-writable by design; a Kubernetes pod mounts a
# volume on /tmp anyway), and the kernel's and the runtime's mounts.
WRITABLE_CHECK = """\
import json, os, stat, sys
allowed = set(sys.argv[1:])
skip = {"/proc", "/sys", "/dev", "/run"}
writable, scratch = [], []
for top, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in skip | allowed]
    for name in [*dirs, *files]:
        path = os.path.join(top, name)
        if os.path.islink(path) or not os.access(path, os.W_OK):
            continue
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode) and mode & stat.S_ISVTX and mode & 0o777 == 0o777:
            scratch.append(path)
        else:
            writable.append(path)
probe = os.path.join(sys.argv[1], "probe")
open(probe, "w").close()
os.unlink(probe)
print(json.dumps({"uid": os.getuid(), "writable": writable, "scratch": sorted(scratch)}))
"""


@pytest.mark.parametrize("image", [PROXY_IMAGE, LOCAL_IMAGE])
def test_its_user_can_write_only_the_cache_directory(image: str) -> None:
    for container in working_container(image):
        result = subprocess.run(
            container.run("python3", "-c", WRITABLE_CHECK, containerfile.CACHE_DIR),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        found = json.loads(result.stdout)
        assert found["uid"] == int(containerfile.UID)
        assert found["writable"] == []
        assert set(found["scratch"]) <= {"/tmp", "/var/tmp"}
        # And the code it runs is where the test looked: the venv and the app in it.
        app = subprocess.run(
            container.run("python3", "-c", "import proxy; print(proxy.__file__)"),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert app.stdout.startswith("/opt/sluice/lib/python3.11/site-packages/proxy/")


def test_without_a_config_the_proxy_image_says_what_to_run(proxy_container: Container) -> None:
    # No --config serves the built-in `local`, which this image has not the model for.
    result = subprocess.run(
        proxy_container.command("serve"), capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert "pip install 'sluice[local]'" in result.stderr
    assert "--config fake" in result.stderr


async def test_the_local_image_serves_smollm2_by_default(
    local_container: Container, tmp_path: Path
) -> None:
    # The built-in config `local`: SmolLM2 loads (torch, then the GGUF: tens of seconds here)
    # while the port answers, then answers one short request.
    with trio.fail_after(240):
        served = await serve_in(local_container, tmp_path / "output", "--port", "0")
        try:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
                while (await client.get(served.url + "/readyz")).status_code != 200:
                    assert served.process.poll() is None, served.said()
                    await trio.sleep(0.5)
                body = chat_body("smollm2", stream=False, max_tokens=8, temperature=0)
                answer = await client.post(served.url + CHAT, json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"].strip()
                page = await client.get(served.url + "/")
                assert page.status_code == 200
                assert page.headers["content-type"].startswith("text/html")
        finally:
            await finish(served)
