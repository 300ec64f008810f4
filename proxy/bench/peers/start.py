"""Starting an installed peer in front of the fake upstream: its config written into the run's
folder, its process owned by a task of the caller's nursery (``children.supervise``: stopped,
shielded and bounded, however the bench ends), pinned where asked, and ready before this
returns. Every peer runs in the foreground as one process tree the bench owns (nginx with
``daemon off``, Portkey's node started directly, not through npm or a shell)."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final

import trio

from proxy.bench.children import (
    PEER_READY_TIMEOUT,
    free_port,
    pinned_argv,
    supervise,
    wait_ready,
)
from proxy.bench.peers import configs, sluice_ref
from proxy.bench.peers.install import (
    PEERS_ROOT,
    PORTKEY_SERVER,
    installed,
    nginx_binary,
    peer_dir,
)
from proxy.bench.peers.specs import PeerSpec, spec
from proxy.bench.report import write_text
from proxy.bench.settings import BenchError, is_sluice_ref

HERE: Final = Path(__file__).resolve().parent
PORTKEY_SHIM: Final = HERE / "portkey_shim.mjs"
HOST: Final = "127.0.0.1"


@dataclass
class StartedPeer:
    """A peer answering: its facts, its address, its process and its log, and the headers each
    request to it must carry in this run (its spec's, those naming this run's fake, LiteLLM's
    master key), by name: a client that sends its own Authorization sends that one once."""

    spec: PeerSpec
    address: tuple[str, int]
    pid: int
    log: Path
    request_headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class _Launch:
    argv: list[str]
    # The path polled until it answers 200 (through to the fake where the peer relays it).
    ready_path: str
    env: dict[str, str] | None = None
    request_headers: tuple[tuple[str, str], ...] = ()


async def start_peer(
    nursery: trio.Nursery,
    name: str,
    fake_url: str,
    workdir: Path,
    *,
    api_key: str,
    model: str,
    cpus: frozenset[int] | None = None,
    root: Path = PEERS_ROOT,
) -> StartedPeer:
    """Peer ``name`` (installed under ``root``: ``ensure_installed`` first) started in
    ``nursery`` in front of ``fake_url``, its files in ``workdir``, and ready."""
    facts = spec(name)
    if not installed(name, root):
        raise BenchError(f"--peer {name}: {facts.package} is not installed under {root}")
    address = (HOST, free_port(HOST))
    launch = _launch(name, peer_dir(name, root), address, fake_url, workdir, api_key, model)
    log = workdir / f"{name}.log"
    argv = pinned_argv(launch.argv, cpus)
    process = await nursery.start(partial(supervise, env=launch.env), facts.title, argv, log)
    await wait_ready(facts.title, address, launch.ready_path, log, PEER_READY_TIMEOUT)
    headers = {**dict(facts.request_headers), **dict(launch.request_headers)}
    return StartedPeer(facts, address, process.pid, log, tuple(headers.items()))


def _launch(
    name: str,
    folder: Path,
    address: tuple[str, int],
    fake_url: str,
    workdir: Path,
    api_key: str,
    model: str,
) -> _Launch:
    bin_dir = folder / "bin"
    if is_sluice_ref(name):
        # Its config is the proxy's own, which only the load bench writes (proxy.bench.run).
        raise BenchError(f"--peer {name} runs in the load bench (python -m proxy.bench) only")
    if name == "trio-floor":
        # A script, not ``-m``: its process imports trio and nothing of ``proxy``.
        argv = [sys.executable, str(HERE / "trio_floor.py"), "--host", address[0]]
        argv += ["--port", str(address[1]), "--upstream", fake_url]
        return _Launch(argv, "/health")
    if name == "fastapi":
        argv = [str(bin_dir / "uvicorn"), "fastapi_gateway:app", "--app-dir", str(HERE)]
        argv += ["--host", address[0], "--port", str(address[1]), "--loop", "uvloop"]
        argv += ["--http", "httptools", "--log-level", "warning", "--no-access-log"]
        return _Launch(argv, "/health", env={"UPSTREAM": fake_url})
    if name == "litellm":
        config = workdir / "litellm.yaml"
        write_text(config, configs.litellm_config(fake_url, model))
        env = {
            # Its documented production stance: a master key, which every request carries.
            "LITELLM_MASTER_KEY": api_key,
            # The model cost map is otherwise fetched from GitHub at start-up.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        argv = configs.litellm_argv(str(bin_dir / "litellm"), address, str(config))
        key = (("authorization", f"Bearer {api_key}"),)
        return _Launch(argv, "/health/liveliness", env=env, request_headers=key)
    if name == "envoy":
        config = workdir / "envoy.yaml"
        write_text(config, configs.envoy_config(address, fake_url))
        return _Launch(configs.envoy_argv(str(bin_dir / "envoy"), str(config)), "/health")
    if name == "nginx":
        return _nginx_launch(address, fake_url, workdir)
    if name in ("vllm-router", "sglang-router"):
        return _router_launch(name, bin_dir, address, fake_url)
    if name == "portkey":
        server = folder / PORTKEY_SERVER
        argv = ["node", "--import", str(PORTKEY_SHIM), str(server)]
        argv += [f"--port={address[1]}", "--headless"]
        headers = configs.portkey_headers(fake_url)
        # production: no UI routes, no log console.
        return _Launch(argv, "/", env={"NODE_ENV": "production"}, request_headers=headers)
    raise BenchError(f"no way to start peer {name!r}")  # every PEER_NAMES entry is above


def _nginx_launch(address: tuple[str, int], fake_url: str, workdir: Path) -> _Launch:
    nginx = nginx_binary()
    if nginx is None:
        raise BenchError("--peer nginx: no nginx on PATH")
    (workdir / "nginx-temp").mkdir(parents=True, exist_ok=True)
    # As root, nginx would run its worker as nobody; the worker runs as whoever runs the bench.
    user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() == 0 else None
    config = workdir / "nginx.conf"
    write_text(config, configs.nginx_config(address, fake_url, str(workdir), user))
    return _Launch(configs.nginx_argv(nginx, str(workdir), str(config)), "/health")


def _router_launch(name: str, bin_dir: Path, address: tuple[str, int], fake_url: str) -> _Launch:
    # Its Prometheus exporter's port too: the default (29000) is one for every router.
    metrics = ["--prometheus-host", HOST, "--prometheus-port", str(free_port(HOST))]
    if name == "vllm-router":
        argv = configs.router_argv(str(bin_dir / "vllm-router"), address, fake_url, "warning")
    else:
        launcher = [str(bin_dir / "python"), "-m", "sglang_router.launch_router"]
        argv = configs.router_argv(launcher, address, fake_url, "warn")
    # sglang-router answers /health before its worker is registered; /readiness after.
    return _Launch(argv + metrics, "/health" if name == "vllm-router" else "/readiness")


def peer_version(name: str, root: Path = PEERS_ROOT) -> str:
    """The version the installed peer reports (nginx: Debian's build; another Sluice: its
    commit), else its pinned one."""
    if is_sluice_ref(name):
        return sluice_ref.version(name, root)
    if name != "nginx":
        return spec(name).version
    nginx = nginx_binary()
    if nginx is None:
        return "not installed"
    try:
        done = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(r"nginx/(\S+)", done.stderr + done.stdout)
    return found.group(1) if found else "unknown"
