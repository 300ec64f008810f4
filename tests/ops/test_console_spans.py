"""Traces without a collector: ``[tracing] exporter = "console"`` writes each finished span as one
line on the log (logger sluice.spans), with nothing of OpenTelemetry imported; a start-up line
says where traces go, whichever way they go."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from proxy.config import ConfigError, TracingConfig, config_from_mapping
from proxy.ops import console_spans, tracing
from tests.support import DEADLINE, chat_body, run_python, start_fake, start_proxy, stop

CHAT = "/v1/chat/completions"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
ROOT = Path(__file__).resolve().parents[2]
# name [kind] duration status trace= span= parent= (then attributes, then " | " events).
LINE = re.compile(
    r"^(?P<name>.+) \[(?P<kind>server|client|internal)\] (?P<ms>\d+\.\d)ms "
    r"(?P<status>unset|ok|error) trace=(?P<trace>[0-9a-f]{8}) span=(?P<span>[0-9a-f]{8}) "
    r"parent=(?P<parent>[0-9a-f]{8}|-)(?P<rest>.*)$"
)


@pytest.fixture(autouse=True)
def tracing_put_back() -> Iterator[None]:
    yield
    if tracing.ACTIVE is not None:
        tracing.ACTIVE.shutdown()


def parsed(line: str) -> dict[str, str]:
    match = LINE.match(line)
    assert match is not None, line
    return match.groupdict()


async def test_a_real_requests_spans_are_lines_on_the_log(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=console_spans.SPANS_LOGGER)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            # Content capture on: the prompt still never reaches a line.
            tracing={"exporter": "console", "capture_content": True},
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(messages=[{"role": "user", "content": "secret prompt"}]),
                headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
            )
        assert response.status_code == 200
        await proxy.state.tracker.wait_idle()
    lines = [r.getMessage() for r in caplog.records if r.name == console_spans.SPANS_LOGGER]
    # Each span as it ends: the upstream attempt, the operation, then the request.
    attempt, operation, server = (parsed(line) for line in lines)
    assert [attempt["name"], operation["name"], server["name"]] == [
        "POST",
        "chat fake-model",
        f"POST {CHAT}",
    ]
    assert [attempt["kind"], operation["kind"], server["kind"]] == ["client", "client", "server"]
    # One trace, the client's; each span under the one before it, the request under the
    # client's own span.
    assert {attempt["trace"], operation["trace"], server["trace"]} == {CLIENT_TRACE[:8]}
    assert server["parent"] == CLIENT_SPAN[:8]
    assert operation["parent"] == server["span"] and attempt["parent"] == operation["span"]
    # The response and the upstream name the same spans.
    _, trace_id, server_span, _ = response.headers["traceresponse"].split("-")
    assert (trace_id, server_span[:8]) == (CLIENT_TRACE, server["span"])
    assert fake.recorder.last().headers["traceparent"].split("-")[2][:8] == attempt["span"]
    assert all(line["status"] == "unset" for line in (attempt, operation, server))
    assert float(server["ms"]) >= float(operation["ms"]) > 0
    assert "sluice.outcome=completed" in server["rest"]
    assert "http.response.status_code=200" in server["rest"]
    assert f"sluice.replica={fake.url}" in attempt["rest"]
    assert "gen_ai.response.time_to_first_chunk=" in operation["rest"]
    assert re.search(r" \| first token \+\d+\.\dms$", operation["rest"]), operation["rest"]
    assert not any("secret prompt" in line for line in lines)


async def test_a_failed_request_is_an_error_line(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=console_spans.SPANS_LOGGER)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, mode="status", status=500)
        proxy = await start_proxy(
            nursery,
            {"fake-model": {"upstreams": [fake.url], "max_attempts": 1}},
            tracing={"exporter": "console"},
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body())
        assert response.status_code == 502
        await proxy.state.tracker.wait_idle()
    lines = [r.getMessage() for r in caplog.records if r.name == console_spans.SPANS_LOGGER]
    server = parsed(lines[-1])
    assert server["status"] == "error" and server["parent"] == "-"
    assert "error.type=upstream_http_error" in server["rest"]
    assert response.headers["traceresponse"].split("-")[1][:8] == server["trace"]


def test_the_console_needs_nothing_of_opentelemetry() -> None:
    script = (
        "import sys\n"
        "from proxy.config import TracingConfig\n"
        "from proxy.ops import tracing\n"
        "assert tracing.install(TracingConfig(exporter='console'), {}) is not None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr


def test_sampling_is_the_same_as_with_the_sdk() -> None:
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    parent = console_spans.extract(unsampled, None)
    assert parent is not None and not parent.span_context.sampled
    # The client's flag is followed; a new trace is sampled by its id's low 64 bits.
    on = console_spans.ConsoleProvider("parentbased_always_on", None).get_tracer("t")
    assert not on.start_span("s", context=parent).context.sampled
    assert on.start_span("s").context.sampled
    root, parent_based = console_spans.sampler("traceidratio", 0.5)
    assert not parent_based
    assert root((1 << 64) + 1) and not root((1 << 63) + 1)
    assert console_spans.extract("00-" + "0" * 32 + f"-{CLIENT_SPAN}-01", None) is None
    assert console_spans.extract("garbage", None) is None
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER='sometimes'"):
        tracing.install(TracingConfig(exporter="console"), {"OTEL_TRACES_SAMPLER": "sometimes"})


def test_an_unknown_exporter_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as error:
        config_from_mapping({"tracing": {"exporter": "zipkin"}})
    assert str(error.value) == (
        "'exporter' in [tracing] must be one of otlp, console, none, not 'zipkin'"
    )
    with pytest.raises(ConfigError, match=r"OTEL_TRACES_EXPORTER='jaeger'.*otlp, console, none"):
        tracing.settings_from(TracingConfig(), {"OTEL_TRACES_EXPORTER": "jaeger"})
    # A setting of the other exporter beside "console" is one of the two by mistake.
    with pytest.raises(ConfigError, match=r"'endpoint' in \[tracing\] is for exporter = \"otlp\""):
        config_from_mapping({"tracing": {"exporter": "console", "endpoint": "http://c:4318"}})
    config = config_from_mapping({}, env={"SLUICE_TRACING_EXPORTER": "console"})
    assert config.tracing.exporter == "console"


OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://user:pw@collector:4318"}


@pytest.mark.parametrize(
    ("section", "env", "line"),
    [
        (
            {},
            {},
            "traces: off (no [tracing] endpoint or OTEL_EXPORTER_OTLP_ENDPOINT; "
            '[tracing] exporter = "console" writes them to the log)',
        ),
        ({"exporter": "none"}, OTLP, 'traces: off ([tracing] exporter = "none")'),
        ({}, {**OTLP, "OTEL_TRACES_EXPORTER": "none"}, "traces: off (OTEL_TRACES_EXPORTER=none)"),
        ({}, {**OTLP, "OTEL_SDK_DISABLED": "true"}, "traces: off (OTEL_SDK_DISABLED=true)"),
        (
            {"exporter": "console"},
            {},
            "traces: console, one line per finished span on the log (logger sluice.spans; "
            "sampler parentbased_always_on)",
        ),
        (
            {"sample_ratio": 0.25},
            OTLP,
            "traces: OTLP http/protobuf to http://collector:4318/v1/traces "
            "(sampler parentbased_traceidratio 0.25)",
        ),
    ],
)
def test_where_traces_go_in_one_line(
    section: dict[str, object], env: dict[str, str], line: str
) -> None:
    config = config_from_mapping({"tracing": section}).tracing
    assert tracing.destination(config, env) == line
    assert tracing.check(config, env) == line


async def serve_and_read_stderr(
    config: Path, env: dict[str, str], until: str, request: bool = False
) -> str:
    """``sluice serve`` in a process of its own: its stderr until a line holds ``until``
    (with ``request``: after one chat completion)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        out = b""
        while b"sluice serving" not in out:
            chunk = await process.stdout.receive_some()
            assert chunk, f"sluice serve exited: {out!r}"
            out += chunk
        if request:
            url = next(w for w in out.decode().split() if w.startswith("http://"))
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                response = await client.post(url + CHAT, json=chat_body())
                assert response.status_code == 200
        err = b""
        while until.encode() not in err:
            chunk = await process.stderr.receive_some()
            assert chunk, f"sluice serve exited: {err!r}"
            err += chunk
        return err.decode()
    finally:
        await process.stdout.aclose()
        await process.stderr.aclose()
        await stop(process)


@pytest.mark.parametrize(
    ("exporter", "said"),
    [
        ("", "traces: off (no [tracing] endpoint"),
        ("otlp", "traces: OTLP http/protobuf to http://127.0.0.1:9/v1/traces"),
        ("console", "traces: console, one line per finished span"),
    ],
)
async def test_sluice_serve_says_where_traces_go(
    nursery: trio.Nursery, tmp_path: Path, exporter: str, said: str
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
    config = tmp_path / "sluice.toml"
    config.write_text(
        f'[server]\nport = 0\n[tracing]\nexporter = "{exporter}"\n'
        f'[models.fake-model]\nupstreams = ["{fake.url}"]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SLUICE_"))}
    if exporter == "otlp":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    console = exporter == "console"
    with trio.fail_after(30):
        # The console's: until the request's own span is written.
        until = "[server]" if console else said
        err = await serve_and_read_stderr(config, env, until, request=console)
    assert said in err, err
    if console:
        # The request's span, on the log with its level and logger, as every log line.
        assert re.search(rf"INFO sluice\.spans: POST {CHAT} \[server\] [\d.]+ms unset ", err), err
