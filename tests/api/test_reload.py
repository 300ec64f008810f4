"""Reload (SIGHUP): the config file is read again and applied; a stream in flight keeps the
settings it began with and finishes; a file that cannot be served is one log line and the old
config goes on; what needs a restart is named and left as it was.

Most tests call the state's reload directly, in-process; one sends SIGHUP to a real
`sluice serve`."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from proxy.api.app import create_app
from proxy.api.auth import KeyRing, hash_key
from proxy.api.reload import plan_reload
from proxy.api.state import SluiceState, state_of
from proxy.config import KeyConfig, LimitsConfig, ServerConfig, config_from_mapping, load_config
from proxy.server.run import serve
from tests.api.test_limits_redis import REDIS_SERVER, RedisServer
from tests.support import (
    DEADLINE,
    Fake,
    chat_body,
    poll_until,
    sse_payloads,
    start_fake,
    start_sluice,
    stop,
)

CHAT = "/v1/chat/completions"


def toml(upstream: str, *keys: str, server: str = "port = 0") -> str:
    """A config serving "fake-model" from ``upstream`` to the clients holding ``keys``."""
    tables = "".join(f'[[keys]]\nname = "{key}"\nsha256 = "{hash_key(key)}"\n' for key in keys)
    return f'[server]\n{server}\n[models.fake-model]\nupstreams = ["{upstream}"]\n{tables}'


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def serve_file(nursery: trio.Nursery, path: Path) -> tuple[str, SluiceState]:
    config = load_config(path, env={})
    app = create_app(config, env={})
    binds = await nursery.start(serve, app, config)
    return binds[0], state_of(app)


def reloads(state: SluiceState, outcome: str) -> float:
    value = state.metrics.config_reloads.labels(outcome)._value.get()
    assert isinstance(value, float)
    return value


@pytest.fixture
async def slow_fake(nursery: trio.Nursery) -> Fake:
    return await start_fake(nursery, ttft=0, interval=0.01, tokens=5)


async def test_a_new_key_works_and_a_removed_one_does_not(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake
) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text(toml(slow_fake.url, "old-key"))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            body = chat_body(stream=False)
            assert (
                await client.post(url + CHAT, json=body, headers=bearer("new-key"))
            ).status_code == 401
            path.write_text(toml(slow_fake.url, "new-key"))
            assert await state.reload_config() == "applied"
            assert (
                await client.post(url + CHAT, json=body, headers=bearer("new-key"))
            ).status_code == 200
            assert (
                await client.post(url + CHAT, json=body, headers=bearer("old-key"))
            ).status_code == 401
            metrics = (await client.get(url + "/metrics")).text
    assert 'sluice_config_reloads_total{outcome="applied"} 1.0' in metrics
    assert 'sluice_config_reloads_total{outcome="invalid"} 0.0' in metrics


async def test_a_broken_file_is_one_line_and_the_old_config_serves(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text(toml(slow_fake.url, "old-key"))
    broken = {
        "not TOML": "[server\n",
        "not valid": toml(slow_fake.url, "old-key", server="port = 0\ngraceful_timeout = -1"),
        "unset api_key_env": toml(slow_fake.url, "old-key").replace(
            "[[keys]]", 'api_key_env = "SLUICE_TEST_UNSET"\n[[keys]]', 1
        ),
        "no model": "[server]\nport = 0\n",
    }
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        before = state.current
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            for number, (why, text) in enumerate(broken.items(), 1):
                path.write_text(text)
                caplog.clear()
                with caplog.at_level(logging.INFO, logger="sluice"):
                    assert await state.reload_config() == "invalid", why
                lines = [r for r in caplog.records if r.name == "sluice.app"]
                assert len(lines) == 1, (why, [r.getMessage() for r in lines])
                assert lines[0].levelno == logging.ERROR
                assert "still serving the previous config" in lines[0].getMessage()
                assert "\n" not in lines[0].getMessage()
                assert state.current is before
                assert reloads(state, "invalid") == number
                response = await client.post(
                    url + CHAT, json=chat_body(stream=False), headers=bearer("old-key")
                )
                assert response.status_code == 200, why


async def test_a_stream_in_flight_keeps_its_upstream_and_finishes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    old = await start_fake(nursery, ttft=0, interval=0.02, tokens=50)
    new = await start_fake(nursery, ttft=0, interval=0, tokens=3)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(old.url, "key"))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        old_generation = state.current
        (old_replica,) = old_generation.replicas.values()
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            text = ""
            async with client.stream(
                "POST", url + CHAT, json=chat_body(), headers=bearer("key")
            ) as response:
                async for chunk in response.aiter_text():
                    text += chunk
                    if state.current is old_generation:
                        # Mid-stream: the file now names another upstream.
                        path.write_text(toml(new.url, "key"))
                        assert await state.reload_config() == "applied"
                        assert old_generation in state.retiring
                        answered = await client.post(
                            url + CHAT, json=chat_body(stream=False), headers=bearer("key")
                        )
                        assert answered.status_code == 200
                        assert len(new.recorder.records) == 1
            assert sse_payloads(text)[-1] == "[DONE]"
            assert len(old.recorder.records) == 1
            assert old.recorder.records[0].tokens_sent == 50
            # Its relay done, the old generation's pools close and its work stops.
            await poll_until(lambda: old_generation not in state.retiring)
            assert old_replica.pool_connections() == []


async def test_an_open_websocket_follows_the_reload(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake
) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text(toml(slow_fake.url, "kept", "removed"))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        ws_url = url.replace("http://", "ws://") + "/v1/ws"
        message = json.dumps(
            {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        )

        async def final(ws: WebSocketConnection) -> dict[str, Any]:
            while True:
                received = json.loads(await ws.get_message())
                if received["type"] != "token":
                    assert isinstance(received, dict)
                    return received

        async with (
            open_websocket_url(ws_url, extra_headers=[(b"Authorization", b"Bearer kept")]) as kept,
            open_websocket_url(
                ws_url, extra_headers=[(b"Authorization", b"Bearer removed")]
            ) as gone,
        ):
            for ws in (kept, gone):
                await ws.send_message(message)
                assert (await final(ws))["type"] == "done"
            path.write_text(toml(slow_fake.url, "kept"))
            assert await state.reload_config() == "applied"
            await kept.send_message(message)
            assert (await final(kept))["type"] == "done"
            await gone.send_message(message)
            refused = await final(gone)
            assert (refused["type"], refused["status"]) == ("error", 401)


async def test_a_server_stopping_closes_a_retiring_generation(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    old = await start_fake(nursery, ttft=0, interval=0.02, tokens=1000)
    new = await start_fake(nursery, ttft=0, interval=0, tokens=3)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(old.url, "key"))
    with trio.fail_after(DEADLINE):
        async with (
            httpx.AsyncClient(timeout=10, trust_env=False) as client,
            trio.open_nursery() as server,
        ):
            url, state = await serve_file(server, path)
            old_generation = state.current
            (old_replica,) = old_generation.replicas.values()

            async def stream() -> None:
                body = chat_body()
                async with client.stream("POST", url + CHAT, json=body, headers=bearer("key")):
                    await trio.sleep_forever()

            server.start_soon(stream)
            await old.recorder.wait_for(lambda r: r.records and r.records[0].tokens_sent)
            path.write_text(toml(new.url, "key"))
            assert await state.reload_config() == "applied"
            assert old_generation in state.retiring
            server.cancel_scope.cancel()
        # Its stream was still running: closed with the server all the same.
        assert old_generation not in state.retiring
        assert old_replica.pool_connections() == []
        await old.recorder.wait_for(lambda r: r.records[0].disconnected_at is not None)


async def test_restart_only_changes_are_named_and_the_rest_applies(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text(toml(slow_fake.url, "old-key"))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        path.write_text(toml(slow_fake.url, "new-key", server="workers = 3\nport = 8999"))
        with caplog.at_level(logging.INFO, logger="sluice"):
            assert await state.reload_config() == "restart_needed"
        (line,) = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
        assert "restart needed for: server.port, server.workers" in line
        assert state.config.server.port == 0 and state.config.server.workers == 1
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                url + CHAT, json=chat_body(stream=False), headers=bearer("new-key")
            )
            assert response.status_code == 200
    assert reloads(state, "restart_needed") == 1


async def test_a_local_model_keeps_its_weights(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake, tiny_loaded_model: Any
) -> None:
    local = '[models.tiny]\nbackend = "local"\npath = "{}"\ndefault_temperature = 0.0\n'
    path = tmp_path / "sluice.toml"
    path.write_text(toml(slow_fake.url) + local.format("unused-preloaded"))
    config = load_config(path, env={})
    app = create_app(config, env={}, local_models={"tiny": tiny_loaded_model})
    with trio.fail_after(DEADLINE):
        url = (await nursery.start(serve, app, config))[0]
        state = state_of(app)
        engine = state.backends["tiny"]
        path.write_text(toml(slow_fake.url) + local.format("other-weights"))
        assert await state.reload_config() == "restart_needed"
        assert state.backends["tiny"] is engine
        assert state.config.model("tiny") == config.model("tiny")
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            body = chat_body("tiny", stream=False, max_tokens=2)
            assert (await client.post(url + CHAT, json=body)).status_code == 200


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (`make redis`)")
async def test_a_new_redis_url_counts_there(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake
) -> None:
    first, second = RedisServer(), RedisServer()
    first.start()
    second.start()
    try:
        limited = f'[[keys]]\nname = "k"\nsha256 = "{hash_key("k")}"\nrequests_per_minute = 1\n'

        def config(redis: RedisServer) -> str:
            return (
                toml(slow_fake.url)
                + limited
                + f'[limits]\nbackend = "redis"\nurl = "{redis.url}"\n'
            )

        path = tmp_path / "sluice.toml"
        path.write_text(config(first))
        with trio.fail_after(DEADLINE):
            url, state = await serve_file(nursery, path)
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:

                async def status() -> int:
                    body = chat_body(stream=False)
                    return (
                        await client.post(url + CHAT, json=body, headers=bearer("k"))
                    ).status_code

                assert [await status(), await status()] == [200, 429]
                path.write_text(config(second))
                assert await state.reload_config() == "applied"
                # Counted in the new Redis, whose window for the key is empty.
                assert [await status(), await status()] == [200, 429]
                path.write_text(config(first))
                assert await state.reload_config() == "applied"
                assert await status() == 429  # the first one's window still holds its request
    finally:
        first.stop()
        second.stop()


def test_the_plan_names_what_needs_a_restart() -> None:
    data: dict[str, Any] = {
        "server": {"port": 0},
        "models": {
            "up": {"upstreams": ["http://127.0.0.1:9"], "passthrough": ["/tokenize"]},
            "tiny": {"backend": "local", "path": "a.gguf"},
        },
    }
    running = config_from_mapping(data, "f.toml", env={})
    # The command line's --port 8123: running on it, while the file says 0.
    running = dataclasses.replace(running, server=ServerConfig(port=8123))
    data["models"]["up"] = {
        "upstreams": ["http://127.0.0.1:10"],
        "passthrough": ["/tokenize", "/x"],
    }
    data["models"]["tiny"]["path"] = "b.gguf"
    data["models"]["new"] = {"backend": "local", "path": "c.gguf"}
    data["tracing"] = {"sample_ratio": 0.5}
    fresh = config_from_mapping(data, "f.toml", env={})
    plan = plan_reload(running, ServerConfig(port=0), fresh)
    assert plan.restart_needed == (
        "tracing.sample_ratio",
        "models.new (a new local model)",
        "models.tiny.path",
        "models.up.passthrough (/x)",
    )
    assert plan.outcome == "restart_needed"
    # The rest applies; what needs a restart stays as it runs.
    assert plan.config.server.port == 8123
    assert plan.config.tracing == running.tracing
    assert [m.name for m in plan.config.models] == ["up", "tiny"]
    assert plan.config.model("tiny") == running.model("tiny")
    up = plan.config.model("up")
    assert up is not None and up.backend == "upstream"
    assert up.upstreams == ("http://127.0.0.1:10",)
    # Nothing that needs a restart: applied.
    unchanged = dataclasses.replace(running, server=ServerConfig(port=0))
    assert plan_reload(running, ServerConfig(port=0), unchanged).outcome == "applied"


def test_the_plan_says_what_the_reload_applies() -> None:
    data: dict[str, Any] = {
        "server": {"port": 0},
        "models": {
            "up": {"upstreams": ["http://127.0.0.1:9"]},
            "gone": {"upstreams": ["http://127.0.0.1:11"]},
        },
        "keys": [
            {"name": "alice", "sha256": hash_key("a")},
            {"name": "carol", "sha256": hash_key("c")},
        ],
    }
    running = config_from_mapping(data, "f.toml", env={})
    unchanged = plan_reload(running, ServerConfig(port=0), running)
    assert unchanged.applied_changes == ()
    data["keys"] = [
        {"name": "alice", "sha256": hash_key("a2"), "requests_per_minute": 5},
        {"name": "bob", "sha256": hash_key("b")},
    ]
    data["models"] = {
        "up": {"upstreams": ["http://127.0.0.1:9"], "total_timeout": 30.0},
        "new": {"upstreams": ["http://127.0.0.1:12"]},
    }
    data["limits"] = {"key_prefix": "other:"}
    fresh = config_from_mapping(data, "f.toml", env={})
    lines = plan_reload(running, ServerConfig(port=0), fresh).applied_changes
    assert lines == (
        "keys added: bob",
        "keys removed: carol",
        "keys changed: alice (sha256, requests_per_minute)",
        "models added: new",
        "models removed: gone",
        "models changed: up (total_timeout)",
        "limits changed: key_prefix",
    )
    # Names and field names only: a key's hash never reaches the log.
    assert not any(hash_key("a2") in line for line in lines)


async def test_a_reloads_log_line_names_the_keys_it_added_and_removed(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.app")
    path = tmp_path / "sluice.toml"
    path.write_text(toml(slow_fake.url, "old-key"))
    with trio.fail_after(DEADLINE):
        _, state = await serve_file(nursery, path)
        path.write_text(toml(slow_fake.url, "new-key"))
        assert await state.reload_config() == "applied"
    lines = [r.getMessage() for r in caplog.records if "config reloaded" in r.getMessage()]
    assert lines == [f"config reloaded from {path}: keys added: new-key; keys removed: old-key"]


def test_a_kept_key_keeps_its_counters_under_its_new_limits() -> None:
    limits = LimitsConfig()
    old = KeyRing(
        [KeyConfig("a", hash_key("a"), requests_per_minute=3, max_concurrent_streams=2)], limits
    )
    key = old.identify("Bearer a")
    old.admit(key, 0.0)
    lease = old.admit(key, 1.0)
    new = KeyRing(
        [
            KeyConfig("a", hash_key("a"), requests_per_minute=2, max_concurrent_streams=3),
            KeyConfig("b", hash_key("b")),
        ],
        limits,
    )
    new.carry_over(old)
    assert new.streams("a") == 2
    renewed = new.identify("Bearer a")
    assert renewed.requests_per_minute == 2
    with pytest.raises(Exception, match="Rate limit"):
        new.admit(renewed, 2.0)  # 2 requests in the last minute: the new limit's
    lease.release()  # a lease of the old ring frees the same counter
    assert new.streams("a") == 1
    assert new.reidentify(key) == renewed
    assert new.streams("b") == 0


async def test_sighup_reloads_a_real_server(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=40)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(fake.url, "old-key"))
    with trio.fail_after(30):
        process, url = await start_sluice(path)
        try:
            # A connection per request: one left idle in the pool may be closed by the server
            # as it is reused (its keep-alive timer, on a loaded machine), and httpx does not
            # send the request again ("Server disconnected without sending a response").
            limits = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=10, trust_env=False, limits=limits) as client:

                async def status(key: str) -> int:
                    body = chat_body(stream=False, fake={"tokens": 1})
                    return (
                        await client.post(url + CHAT, json=body, headers=bearer(key))
                    ).status_code

                text = ""
                async with client.stream(
                    "POST", url + CHAT, json=chat_body(), headers=bearer("old-key")
                ) as response:
                    async for chunk in response.aiter_text():
                        if not text:
                            # A stream in flight (2 s of tokens): the key rotates under it.
                            assert await status("new-key") == 401
                            path.write_text(toml(fake.url, "old-key", "new-key"))
                            process.send_signal(signal.SIGHUP)
                            with trio.fail_after(3):
                                while await status("new-key") != 200:  # noqa: ASYNC110
                                    await trio.sleep(0.05)
                        text += chunk
                assert sse_payloads(text)[-1] == "[DONE]"
                assert process.returncode is None

                path.write_text("[server\nport = 0\n")
                process.send_signal(signal.SIGHUP)
                invalid = 'sluice_config_reloads_total{outcome="invalid"} 1.0'
                with trio.fail_after(3):
                    while invalid not in (await client.get(url + "/metrics")).text:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                assert await status("old-key") == 200
                assert await status("new-key") == 200
                assert await status("other-key") == 401
                metrics = (await client.get(url + "/metrics")).text
                assert 'sluice_config_reloads_total{outcome="applied"} 1.0' in metrics
        finally:
            await stop(process)


async def test_a_sighup_keeps_idle_keep_alive_connections(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A reload swaps the config under the server, not the server: a client's idle pooled
    connection is still open after it, and its next request goes on that same connection (a
    pool that found it closed would fail a POST, which clients do not send again). The server's
    keep-alive timer is set long, so only the reload could close it."""
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=1)
    path = tmp_path / "sluice.toml"
    server = "port = 0\nkeep_alive_timeout = 120.0"
    path.write_text(toml(fake.url, "old-key", server=server))
    limits = httpx.Limits(max_connections=1)
    body = chat_body(stream=False, fake={"tokens": 1})
    with trio.fail_after(30):
        process, url = await start_sluice(path)
        try:
            async with httpx.AsyncClient(timeout=10, trust_env=False, limits=limits) as client:

                async def local_port(key: str) -> int:
                    response = await client.post(url + CHAT, json=body, headers=bearer(key))
                    assert response.status_code == 200
                    return int(
                        response.extensions["network_stream"].get_extra_info("client_addr")[1]
                    )

                before = await local_port("old-key")
                for round_ in range(3):
                    path.write_text(toml(fake.url, "old-key", f"key-{round_}", server=server))
                    process.send_signal(signal.SIGHUP)
                    applied = f'sluice_config_reloads_total{{outcome="applied"}} {round_ + 1}.0'
                    with trio.fail_after(5):
                        while applied not in (await client.get(url + "/metrics")).text:  # noqa: ASYNC110
                            await trio.sleep(0.05)
                    # Idle a while after the reload, as a pooled connection is between requests.
                    await trio.sleep(0.3)
                    assert await local_port(f"key-{round_}") == before
                assert process.returncode is None
        finally:
            await stop(process)


async def test_a_sighups_log_line_says_what_changed(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A real server, a real SIGHUP: the reload's line on stderr names the keys added and
    removed (never a hash) and what changed of a model and of [limits]."""
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=1)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(fake.url, "old-key", "kept-key"))
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    err = b""

    async def stderr_until(text: bytes) -> None:
        nonlocal err
        assert process.stderr is not None
        while text not in err:
            chunk = await process.stderr.receive_some()
            assert chunk, f"sluice serve exited: {err!r}"
            err += chunk

    try:
        with trio.fail_after(30):
            await stderr_until(b"Running on")
            edited = toml(fake.url, "kept-key", "new-key").replace(
                "[models.fake-model]\n", "[limits]\nkey_prefix = 'x:'\n[models.fake-model]\n"
            )
            path.write_text(edited.replace("[[keys]]", "total_timeout = 30.0\n[[keys]]", 1))
            process.send_signal(signal.SIGHUP)
            await stderr_until(b"config reloaded")
            await stderr_until(b"\n")
    finally:
        await process.stdout.aclose()
        await process.stderr.aclose()
        await stop(process)
    (line,) = [line for line in err.decode().splitlines() if "config reloaded" in line]
    assert line.endswith(
        f"config reloaded from {path}: keys added: new-key; keys removed: old-key; "
        "models changed: fake-model (total_timeout); limits changed: key_prefix"
    ), line
    assert not any(hash_key(key) in err.decode() for key in ("old-key", "kept-key", "new-key"))


async def test_sighup_to_the_supervisor_reloads_every_worker(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """With --workers, the supervisor passes SIGHUP on: every worker reads the file again (the
    kernel spreads fresh connections among them, so many of them must all see the new key)."""
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=1)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(fake.url, "old-key"))
    with trio.fail_after(60):
        process, url = await start_sluice(path, "--workers", "2")
        try:
            assert await statuses(url, "new-key") == {401}
            path.write_text(toml(fake.url, "old-key", "new-key"))
            process.send_signal(signal.SIGHUP)
            with trio.fail_after(5):
                while await statuses(url, "new-key") != {200}:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            # Stable: every worker has it, not one of them by chance.
            assert await statuses(url, "new-key", 24) == {200}
            assert process.returncode is None
        finally:
            await stop(process)


async def test_sighups_while_the_workers_start_end_none_of_them_and_are_not_lost(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The supervisor serves before every worker is up; a SIGHUP passed on to a worker still
    starting (SIGHUP's default action ends a process until it sets its own) must neither end it
    (the supervisor then stopped the whole server) nor be lost: it waits for the worker's
    server, which reloads."""
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=1)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(fake.url, "old-key"))
    with trio.fail_after(60):
        process, url = await start_sluice(path, "--workers", "2")
        try:
            path.write_text(toml(fake.url, "old-key", "new-key"))
            # From the first moment the supervisor serves, through the workers' start.
            for _ in range(20):
                process.send_signal(signal.SIGHUP)
                await trio.sleep(0.05)
            with trio.fail_after(10):
                while await statuses(url, "new-key") != {200}:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            assert await statuses(url, "new-key", 24) == {200}
            assert process.returncode is None
        finally:
            await stop(process)


async def statuses(url: str, key: str, count: int = 12) -> set[int]:
    """The statuses of ``count`` requests with ``key``, each on a connection of its own (the
    kernel gives each to any worker)."""
    seen = set()
    for _ in range(count):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            body = chat_body(stream=False)
            response = await client.post(url + CHAT, json=body, headers=bearer(key))
            seen.add(response.status_code)
    return seen


async def test_the_scheduler_keeps_its_counters_queue_and_in_flight_across_a_reload(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A reload builds the replicas anew; the scheduler is the process's: what a key has been
    served, what waits and what runs on a replica all carry over, and a new max_connections
    applies at once."""
    fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=100)

    def config(slots: int) -> str:
        return toml(fake.url, "a").replace(
            "[models.fake-model]\n", f"[models.fake-model]\nmax_connections = {slots}\n"
        )

    path = tmp_path / "sluice.toml"
    path.write_text(config(1))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        counters = state.scheduling.upstream.queue.counters
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            finished: list[int] = []

            async def ask(stream: bool) -> None:
                body = chat_body(stream=stream)
                response = await client.post(url + CHAT, json=body, headers=bearer("a"))
                finished.append(response.status_code)

            nursery.start_soon(ask, True)  # holds the one slot for about 2 s
            (replica,) = state.current.replicas.values()
            await poll_until(lambda: replica.room.in_flight == 1)
            nursery.start_soon(ask, False)
            await poll_until(lambda: state.current.backends["fake-model"].admission.waiting == 1)
            served = counters["a"]
            assert served > 0  # the running request's prompt, and its output as it streams

            path.write_text(config(2))
            assert await state.reload_config() == "applied"
            (renewed,) = state.current.replicas.values()
            assert renewed is not replica
            # The same room: the running request still counts, and the new slot serves the
            # waiting one at once, while the first still streams.
            assert renewed.room is replica.room
            await poll_until(lambda: len(fake.recorder.records) == 2)
            assert finished == []
            assert renewed.room.in_flight == 2
            assert counters is state.scheduling.upstream.queue.counters
            assert counters["a"] >= served
            await poll_until(lambda: len(finished) == 2)
    assert finished == [200, 200]
    assert renewed.room.in_flight == 0


async def test_one_queue_per_model_across_reloads_and_removed_replicas_send_waiters_elsewhere(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A reload keeps the model's one queue (one max_queue, one gauge): the requests queued
    before it count against the bound after it. A replica the reload removes takes nothing
    more, and what waited for it goes to the model's replicas now."""
    old_fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=100)
    new_fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=3)

    def config(upstream: str) -> str:
        return toml(upstream, "a").replace(
            "[models.fake-model]\n", "[models.fake-model]\nmax_connections = 1\nmax_queue = 2\n"
        )

    path = tmp_path / "sluice.toml"
    path.write_text(config(old_fake.url))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        admission = state.current.backends["fake-model"].admission
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            finished: list[tuple[str, int]] = []

            async def ask(name: str, stream: bool) -> None:
                body = chat_body(stream=stream)
                response = await client.post(url + CHAT, json=body, headers=bearer("a"))
                finished.append((name, response.status_code))

            nursery.start_soon(ask, "holder", True)  # holds the old replica's slot ~2 s
            await poll_until(lambda: len(old_fake.recorder.records) == 1)
            nursery.start_soon(ask, "queued1", False)
            nursery.start_soon(ask, "queued2", False)
            await poll_until(lambda: admission.waiting == 2)
            (old_replica,) = state.current.replicas.values()

            path.write_text(config(new_fake.url))
            assert await state.reload_config() == "applied"
            backend = state.current.backends["fake-model"]
            assert backend.admission is admission  # one queue, one bound, one gauge
            assert old_replica.room.retired
            # The two queued before the reload went to the new replica, one at a time, while
            # the holder still streams from the old one.
            await poll_until(lambda: sum(name != "holder" for name, _ in finished) == 2)
            assert ("queued1", 200) in finished and ("queued2", 200) in finished
            assert len(new_fake.recorder.records) == 2
            assert not any(name == "holder" for name, _ in finished)
            assert len(old_fake.recorder.records) == 1
            await poll_until(lambda: len(finished) == 3)
    assert sorted(finished) == [("holder", 200), ("queued1", 200), ("queued2", 200)]
    assert admission.waiting == 0 and old_replica.room.in_flight == 0


async def test_a_reload_that_turns_preemption_off_applies_to_requests_already_waiting(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=150)
    keys = "".join(
        f'[[keys]]\nname = "{name}"\nsha256 = "{hash_key(name)}"\npriority = {band}\n'
        for name, band in (("urgent", 0), ("batch", 5))
    )

    def config(preempt_after: float) -> str:
        return (
            f"[server]\nport = 0\n[scheduling]\npreempt_after = {preempt_after}\n"
            f'[models.fake-model]\nupstreams = ["{fake.url}"]\nmax_connections = 1\n{keys}'
        )

    path = tmp_path / "sluice.toml"
    path.write_text(config(1.0))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        admission = state.current.backends["fake-model"].admission
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            done: list[str] = []

            async def ask(name: str) -> None:
                response = await client.post(url + CHAT, json=chat_body(), headers=bearer(name))
                assert response.status_code == 200
                done.append(name)

            nursery.start_soon(ask, "batch")  # ~3 s of streaming
            await poll_until(lambda: len(fake.recorder.records) == 1)
            nursery.start_soon(ask, "urgent")
            await poll_until(lambda: admission.waiting == 1)
            # Waiting already, with preempt_after 1 s: the reload turns preemption off.
            path.write_text(config(0.0))
            assert await state.reload_config() == "applied"
            await trio.sleep(1.5)
            # Nothing paused: the urgent request waits for the batch stream's end.
            assert len(fake.recorder.records) == 1
            await poll_until(lambda: len(done) == 2)
    assert done == ["batch", "urgent"]


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (make redis)")
async def test_a_reload_to_redis_limits_starts_sharing_the_keys_counters(
    nursery: trio.Nursery, tmp_path: Path, slow_fake: Fake
) -> None:
    redis = RedisServer()
    redis.start()
    try:
        path = tmp_path / "sluice.toml"
        path.write_text(toml(slow_fake.url, "a"))
        with trio.fail_after(DEADLINE):
            _, state = await serve_file(nursery, path)
            assert state.shared_service is None  # in memory: nothing to share
            path.write_text(
                toml(slow_fake.url, "a")
                + f'[limits]\nbackend = "redis"\nurl = "{redis.url}"\n'
                + "[scheduling]\nshare_seconds = 0.1\n"
            )
            assert await state.reload_config() == "applied"
            shared = state.shared_service
            assert shared is not None and shared.interval == 0.1
            # It syncs with the reloaded config's store.
            assert await shared.sync()
    finally:
        redis.stop()


async def test_a_reload_applies_share_seconds(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=3)
    path = tmp_path / "sluice.toml"
    path.write_text(toml(fake.url, "a"))
    with trio.fail_after(DEADLINE):
        _, state = await serve_file(nursery, path)
        from proxy.api.shared_service import SharedService

        shared = SharedService(state.scheduling.upstream, lambda: None, interval=1.0)
        state.shared_service = shared
        path.write_text(
            toml(fake.url, "a").replace("[server]", "[scheduling]\nshare_seconds = 0.25\n[server]")
        )
        assert await state.reload_config() == "applied"
        assert shared.interval == 0.25
