"""OpenTelemetry traces, against a real OTLP/HTTP receiver (proxy/testing/otlp_receiver.py): set
up with only the standard variables, each request's spans end on every exit path with the
access line's outcome, the client's trace is continued into the upstream, and the response
names its trace. Exporting never delays a request."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from proxy.config import ConfigError, TracingConfig
from proxy.ops import otel_adapter, tracing
from proxy.ops.logs import ACCESS_LOGGER
from proxy.testing.otlp_receiver import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    Receiver,
    otlp_receiver,
)
from tests.ops.test_metrics import closed_port
from tests.support import (
    DEADLINE,
    UPSTREAM_TRANSPORTS,
    Proxy,
    RawClient,
    access_lines,
    chat_body,
    sse_payloads,
    start_fake,
    start_proxy,
)
from tests.tracing_support import flush, tracing_env, tree

CHAT = "/v1/chat/completions"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture(autouse=True)
def tracing_put_back() -> Iterator[None]:
    """No later test is traced by this one's set-up."""
    yield
    if tracing.ACTIVE is not None:
        tracing.ACTIVE.shutdown()


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        yield caplog


async def start_local_traced(nursery: trio.Nursery, receiver: Receiver, loaded: Any) -> Proxy:
    """A proxy serving the tiny local model as "tiny", traced into ``receiver``."""
    from tests.support import local_model

    return await start_proxy(
        nursery, {"tiny": local_model()}, local_models={"tiny": loaded}, env=tracing_env(receiver)
    )


def trace_of(response: httpx.Response) -> str:
    """The trace id the response's traceresponse names."""
    return response.headers["traceresponse"].split("-")[1]


# -- configuration ---------------------------------------------------------------------------


def test_off_without_an_endpoint() -> None:
    assert tracing.settings_from(TracingConfig(), {}) is None
    assert tracing.install(TracingConfig(), {}) is None
    assert tracing.ACTIVE is None


def test_standard_variables_and_the_section_winning() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-token=a%20b,tenant=t1",
        "OTEL_SERVICE_NAME": "edge",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "SECRET_HEADERS": "authorization=Bearer s3cret",
    }
    settings = tracing.settings_from(TracingConfig(), env)
    assert settings is not None
    assert settings.endpoint == "http://collector:4318/v1/traces"
    assert settings.protocol == "http/protobuf"
    assert settings.headers == {"x-token": "a b", "tenant": "t1"}
    assert (settings.service_name, settings.sampler, settings.sampler_arg) == (
        "edge",
        "traceidratio",
        0.25,
    )
    assert not settings.capture_content
    section = TracingConfig(
        endpoint="http://other:4318/", headers_env="SECRET_HEADERS", sample_ratio=0.5
    )
    settings = tracing.settings_from(section, env)
    assert settings is not None
    assert settings.endpoint == "http://other:4318/v1/traces"
    assert settings.headers == {"authorization": "Bearer s3cret"}
    assert (settings.sampler, settings.sampler_arg) == ("parentbased_traceidratio", 0.5)
    # The traces endpoint is used as it is; OTEL_SDK_DISABLED turns everything off.
    only = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom"}
    assert tracing.settings_from(TracingConfig(), only).endpoint == "http://c:4318/custom"  # type: ignore[union-attr]
    assert tracing.settings_from(TracingConfig(), {**env, "OTEL_SDK_DISABLED": "true"}) is None


def test_section_and_its_environment_overrides() -> None:
    from proxy.config import config_from_mapping

    config = config_from_mapping(
        {"tracing": {"endpoint": "http://c:4318", "capture_content": True}},
        env={"SLUICE_TRACING_SAMPLE_RATIO": "0.1", "SLUICE_TRACING_HEADERS_ENV": "H"},
    )
    assert config.tracing == TracingConfig("http://c:4318", "H", 0.1, True)
    with pytest.raises(ConfigError, match="sample_ratio"):
        config_from_mapping({"tracing": {"sample_ratio": 2}})
    with pytest.raises(ConfigError, match="endpoint"):
        config_from_mapping({"tracing": {"endpoint": "collector:4318"}})
    with pytest.raises(ConfigError, match="names MISSING, which is not set"):
        tracing.settings_from(TracingConfig("http://c:4318", headers_env="MISSING"), {})
    settings = tracing.settings_from(config.tracing, {"H": "a=b"})
    assert settings is not None and settings.capture_content


def test_grpc_without_its_exporter_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    # Not installed here; made sure of even where it is.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        tracing.check(TracingConfig(), env)
    with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        tracing.install(TracingConfig(), env)
    assert tracing.ACTIVE is None
    with pytest.raises(ConfigError, match="http/protobuf or grpc"):
        tracing.check(TracingConfig(), {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_the_adapter_finds_the_queue_it_counts_drops_in() -> None:
    otel_adapter.check()
    processor = otel_adapter.CountingBatchProcessor(
        otel_adapter.exporter("http/protobuf", "http://127.0.0.1:9/v1/traces", {}, 1.0),
        4,
        lambda: None,
    )
    try:
        assert processor._queue is not None
    finally:
        processor.shutdown()


# -- the spans of a request ------------------------------------------------------------------


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_a_completed_stream_continues_the_clients_trace_into_the_upstream(
    nursery: trio.Nursery, receiver: Receiver, access: pytest.LogCaptureFixture, transport: str
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)
        proxy = await start_proxy(
            nursery,
            {"fake-model": {"upstreams": [fake.url], "transport": transport}},
            env=tracing_env(receiver),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(),
                headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
            )
        assert response.status_code == 200
        await flush(proxy)
    server, operation, (attempt,) = tree(receiver.of_trace(CLIENT_TRACE))
    # The client's trace, continued: its span is the parent, its tracestate kept.
    assert server.parent_span_id == CLIENT_SPAN
    assert server.trace_state == TRACESTATE
    assert server.service == "sluice"
    assert server.attributes["sluice.outcome"] == "completed"
    assert server.attributes["http.response.status_code"] == 200
    assert server.status == STATUS_UNSET
    # The response and the access line name the trace (and the server span).
    assert response.headers["traceresponse"] == f"00-{CLIENT_TRACE}-{server.span_id}-01"
    (line,) = access_lines(access)
    assert line["trace_id"] == CLIENT_TRACE
    assert operation.name == "chat fake-model"
    assert operation.kind == KIND_CLIENT
    attributes = operation.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "fake-model"
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["server.address"] == "127.0.0.1"
    assert attributes["sluice.outcome"] == "completed"
    assert attributes["sluice.tokens.delivered"] == line["events"] >= 5
    ttft = attributes["gen_ai.response.time_to_first_chunk"]
    assert ttft == pytest.approx(line["ttft_s"], abs=1e-6)
    assert set(operation.events) == {"first token"}
    assert operation.start <= operation.event_times["first token"] <= operation.end
    # The attempt's span is the upstream's parent: vLLM's own span becomes its child.
    assert attempt.kind == KIND_CLIENT
    assert attempt.attributes["http.request.resend_count"] == 0
    assert attempt.attributes["sluice.replica"] == fake.url
    assert attempt.attributes["sluice.outcome"] == "completed"
    sent = fake.recorder.last().headers
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{attempt.span_id}-01"
    assert sent["tracestate"] == TRACESTATE


async def test_a_client_that_leaves_mid_stream(nursery: trio.Nursery, receiver: Receiver) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=1000)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, env=tracing_env(receiver))
        raw = await RawClient.post(proxy, CHAT, chat_body())
        await raw.read_until(b"data: ", count=3)
        assert b"traceresponse: 00-" in raw.received
        await raw.close()
        await flush(proxy)
    (server,) = [span for span in receiver.spans if span.kind == KIND_SERVER]
    server, operation, (attempt,) = tree(receiver.of_trace(server.trace_id))
    assert server.parent_span_id == ""  # no traceparent: a new trace
    for span in (server, operation):
        assert span.attributes["sluice.outcome"] == "cancelled(mid_stream)"
        # A client that leaves is not Sluice's error.
        assert span.status == STATUS_UNSET
        assert "error.type" not in span.attributes
    assert attempt.attributes["sluice.outcome"] == "cancelled"
    assert attempt.status == STATUS_UNSET
    # When the client left, and when the upstream was closed after it.
    times = operation.event_times
    assert times["first token"] <= times["client disconnected"] <= times["upstream closed"]
    assert times["upstream closed"] <= operation.end <= server.end
    latency = operation.attributes["sluice.cancel.latency_s"]
    assert 0 <= latency < 1
    assert operation.events["upstream closed"]["sluice.cancel.latency_s"] == latency
    assert operation.attributes["sluice.tokens.delivered"] >= 2


async def test_an_upstream_failure_is_an_error_with_its_type(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    with trio.fail_after(DEADLINE):
        dead = f"http://127.0.0.1:{closed_port()}"
        proxy = await start_proxy(
            nursery,
            {"fake-model": {"upstreams": [dead], "max_attempts": 1}},
            env=tracing_env(receiver),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body())
        assert response.status_code == 502
        await flush(proxy)
    trace_id = response.headers["traceresponse"].split("-")[1]
    server, operation, (attempt,) = tree(receiver.of_trace(trace_id))
    for span in (server, operation, attempt):
        assert span.status == STATUS_ERROR
        assert span.attributes["error.type"] == "upstream_connect_error"
        assert span.attributes["sluice.outcome"] == "upstream_connect_error"


async def test_a_refusal_ends_its_server_span(nursery: trio.Nursery, receiver: Receiver) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, env=tracing_env(receiver))
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, content=b"{")
        assert response.status_code == 400
        await flush(proxy)
    (server,) = receiver.of_trace(response.headers["traceresponse"].split("-")[1])
    assert server.attributes["sluice.outcome"] == "invalid_json"
    assert server.attributes["error.type"] == "invalid_json"
    assert server.status == STATUS_UNSET  # the client's error, not Sluice's


async def test_a_websocket_message_is_a_span_under_the_handshakes_trace(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=4)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, env=tracing_env(receiver))
        url = proxy.url.replace("http://", "ws://") + "/v1/ws"
        headers = [(b"traceparent", TRACEPARENT.encode()), (b"tracestate", TRACESTATE.encode())]
        async with open_websocket_url(url, extra_headers=headers) as ws:
            finals = []
            for _ in range(2):
                await ws.send_message(
                    json.dumps(
                        {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
                    )
                )
                while (final := json.loads(await ws.get_message()))["type"] == "token":
                    pass
                finals.append(final)
        await flush(proxy)
    assert [final["type"] for final in finals] == ["done", "done"]
    assert [final["trace_id"] for final in finals] == [CLIENT_TRACE, CLIENT_TRACE]
    spans = receiver.of_trace(CLIENT_TRACE)
    servers = [span for span in spans if span.kind == KIND_SERVER]
    assert len(servers) == 2
    for server in servers:
        assert server.name == "WS /v1/ws"
        assert server.parent_span_id == CLIENT_SPAN
        assert server.attributes["sluice.outcome"] == "completed"
        (operation,) = [span for span in spans if span.parent_span_id == server.span_id]
        assert operation.attributes["sluice.outcome"] == "completed"
        assert "first token" in operation.events


# -- exporting never hurts a request ---------------------------------------------------------


@pytest.mark.parametrize("trouble", ["down", "fail", "slow"])
@pytest.mark.usefixtures("quiet_collector")
async def test_a_collector_in_trouble_never_delays_a_request(
    nursery: trio.Nursery, receiver: Receiver, trouble: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tiny queue, so that the spans of a few requests overflow it while the collector is stuck.
    monkeypatch.setattr(tracing, "MAX_QUEUE_SIZE", 3)
    monkeypatch.setattr(tracing, "EXPORT_TIMEOUT", 1.0)
    receiver.mode = trouble
    env = tracing_env(receiver)
    if trouble == "down":
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}/v1/traces"
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, env=env)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            for _ in range(6):
                started = trio.current_time()
                response = await client.post(proxy.url + CHAT, json=chat_body())
                assert response.status_code == 200
                assert "traceresponse" in response.headers
                # Well under the exporter's timeout (and its retries): nobody waited on it.
                assert trio.current_time() - started < 0.5
            await proxy.state.tracker.wait_idle()
            text = (await client.get(proxy.url + "/metrics")).text
    dropped = [
        line for line in text.splitlines() if line.startswith("sluice_trace_spans_dropped_total")
    ]
    assert dropped, text
    # 18 spans into a queue of 3 whose exporter is stuck on its first batch: most dropped.
    if trouble == "slow":
        assert float(dropped[0].split()[-1]) > 0


# -- the other exit paths --------------------------------------------------------------------


async def test_a_hedges_loser_is_marked_and_ended(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    with trio.fail_after(DEADLINE):
        slow = await start_fake(nursery, ttft=10, interval=0.01, tokens=3)
        fast = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [slow.url, fast.url], "hedge_after": 0.2}},
            env=tracing_env(receiver),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 200
        await flush(proxy)
    _, operation, attempts = tree(receiver.of_trace(trace_of(response)))
    assert operation.attributes["sluice.outcome"] == "completed"
    by_replica = {span.attributes["sluice.replica"]: span for span in attempts}
    loser, winner = by_replica[slow.url], by_replica[fast.url]
    assert loser.attributes["http.request.resend_count"] == 0
    assert winner.attributes["http.request.resend_count"] == 1
    assert loser.attributes["sluice.outcome"] == "hedge_lost"
    assert loser.attributes["sluice.hedge.lost"] is True
    assert loser.status == STATUS_UNSET
    assert winner.attributes["sluice.outcome"] == "completed"
    # Each upstream saw its own attempt as its parent.
    assert slow.recorder.last().headers["traceparent"].split("-")[2] == loser.span_id
    assert fast.recorder.last().headers["traceparent"].split("-")[2] == winner.span_id


async def test_a_first_token_deadline_is_an_error(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=10)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "first_token_timeout": 0.1, "max_attempts": 1}},
            env=tracing_env(receiver),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 504
        await flush(proxy)
    server, operation, (attempt,) = tree(receiver.of_trace(trace_of(response)))
    for span in (server, operation, attempt):
        assert span.status == STATUS_ERROR
        assert span.attributes["error.type"] == "upstream_first_token_timeout"


async def test_the_local_model_is_an_internal_operation(
    nursery: trio.Nursery, receiver: Receiver, tiny_loaded_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_local_traced(nursery, receiver, tiny_loaded_model)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + CHAT, json=chat_body("tiny", stream=False, max_tokens=3)
            )
        assert response.status_code == 200
        await flush(proxy)
    _, operation, stages = tree(receiver.of_trace(trace_of(response)))
    assert operation.name == "chat tiny"
    assert operation.kind == KIND_INTERNAL
    attributes = operation.attributes
    assert attributes["gen_ai.provider.name"] == "sluice.local"
    assert attributes["sluice.outcome"] == "completed"
    answer = response.json()
    assert attributes["gen_ai.response.id"] == answer["id"]
    assert attributes["gen_ai.response.model"] == "tiny"
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 3
    # Non-streamed: its one write is no first token of a stream.
    assert "first token" not in operation.events
    # The model's stages, one after another, inside the operation.
    queue, prefill, decode = sorted(stages, key=lambda span: span.start)
    assert [queue.name, prefill.name, decode.name] == ["queue wait", "prefill", "decode"]
    assert all(span.kind == KIND_INTERNAL for span in stages)
    assert operation.start <= queue.start <= queue.end <= prefill.start
    assert prefill.end <= decode.start <= decode.end <= operation.end
    assert prefill.attributes["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert decode.attributes["sluice.local.tokens"] == 3


async def test_a_local_generation_stopped_for_a_client_that_left(
    nursery: trio.Nursery, receiver: Receiver, tiny_loaded_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_local_traced(nursery, receiver, tiny_loaded_model)
        body = chat_body("tiny", stream=True)
        body["ignore_eos"] = True
        raw = await RawClient.post(proxy, CHAT, body)
        await raw.read_until(b"data: ", count=4)
        await raw.close()
        await flush(proxy)
    (server,) = [span for span in receiver.spans if span.kind == KIND_SERVER]
    _, operation, stages = tree(receiver.of_trace(server.trace_id))
    assert operation.attributes["sluice.outcome"] == "cancelled(mid_stream)"
    assert "upstream closed" not in operation.events
    stopped = operation.events["generation stopped"]
    assert stopped["sluice.local.decode_step"] >= 3
    # Every token generated after the leave, as sluice_local_tokens_for_nobody_total counts.
    for_nobody = stopped["sluice.tokens.for_nobody"]
    assert operation.attributes["sluice.tokens.for_nobody"] == for_nobody
    metric = proxy.state.metrics.local_tokens_for_nobody.labels("tiny")._value.get()
    assert for_nobody == metric
    times = operation.event_times
    assert times["client disconnected"] <= times["generation stopped"] <= operation.end
    decode = next(span for span in stages if span.name == "decode")
    assert decode.attributes["sluice.stopped"] is True
    assert decode.end <= operation.end


async def test_off_the_response_names_no_trace(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        assert proxy.state.tracing is None
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + CHAT, json=chat_body(), headers={"traceparent": TRACEPARENT}
            )
        assert response.status_code == 200
        assert "traceresponse" not in response.headers
        # Nothing of the client's trace reaches the upstream either.
        assert "traceparent" not in fake.recorder.last().headers


async def test_a_stream_cut_by_shutdown_is_an_error(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    from functools import partial

    from proxy.api.app import create_app
    from proxy.config import config_from_mapping
    from proxy.server.run import serve

    fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=10_000)
    config = config_from_mapping(
        {
            "server": {"port": 0, "graceful_timeout": 0.2},
            "upstream": {"preconnect": 0},
            "models": {"fake-model": {"upstreams": [fake.url]}},
        },
        env={},
    )
    app = create_app(config, env=tracing_env(receiver))
    stop = trio.Event()
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as server:
            binds = await server.start(partial(serve, app, config, shutdown_trigger=stop.wait))
            proxy = Proxy(binds[0], app, config)
            raw = await RawClient.post(proxy, CHAT, chat_body())
            await raw.read_until(b"data: ", count=3)
            stop.set()  # the stream cannot finish within graceful_timeout: it is stopped
        # The server has stopped, and its tracing exported what was queued on the way out.
        await raw.stream.aclose()
    (server_span,) = [span for span in receiver.spans if span.kind == KIND_SERVER]
    server_span, operation, (attempt,) = tree(receiver.of_trace(server_span.trace_id))
    for span in (server_span, operation):
        # Stopped as the grace ended, its client told in-band: an error of the server's.
        assert span.attributes["sluice.outcome"] == "shutting_down"
        assert span.status == STATUS_ERROR
        assert span.attributes["error.type"] == "shutting_down"
    assert "client disconnected" not in operation.events
    assert attempt.end <= operation.end


async def test_browsers_may_read_the_traceresponse(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            env=tracing_env(receiver),
            server={"cors_origins": ["https://app.example"]},
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + CHAT, json=chat_body(), headers={"Origin": "https://app.example"}
            )
        assert response.status_code == 200
        exposed = response.headers["access-control-expose-headers"].lower()
        assert "traceresponse" in exposed
        assert response.headers["traceresponse"].startswith("00-")


async def test_a_stalled_client_is_not_an_error(nursery: trio.Nursery, receiver: Receiver) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=1_500_000)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            env=tracing_env(receiver),
            relay={"stall_timeout": 1.0},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(stream=False), rcvbuf=4096)
        await proxy.state.tracker.wait_until(lambda tracker: tracker.started == 1)
        await flush(proxy)
        assert proxy.state.tracker.stalled == 1
        await raw.stream.aclose()
    (server,) = [span for span in receiver.spans if span.kind == KIND_SERVER]
    server, operation, (attempt,) = tree(receiver.of_trace(server.trace_id))
    for span in (server, operation):
        assert span.attributes["sluice.outcome"] == "stalled"
        assert span.status == STATUS_UNSET
        assert "error.type" not in span.attributes
    assert attempt.end <= operation.end


# -- what the answer says of itself --------------------------------------------------------

ENDPOINT_CASES = {
    "chat stream": (
        CHAT,
        chat_body(stream_options={"include_usage": True}),
    ),
    "chat whole": (CHAT, chat_body(stream=False)),
    "completions": (
        "/v1/completions",
        {
            "model": "fake-model",
            "prompt": "hi",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "responses": ("/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}),
    "messages": (
        "/v1/messages",
        {
            "model": "fake-model",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        },
    ),
    "embeddings": ("/v1/embeddings", {"model": "fake-model", "input": "hi"}),
}


# Why each answer finished, in the endpoint's own words (the fake ends every answer so).
FINISHED = {
    "chat stream": "stop",
    "chat whole": "stop",
    "completions": "stop",
    "responses": "completed",
    "messages": "end_turn",
}


def _said(response: httpx.Response) -> dict[str, Any]:
    """What the client was told of the answer's id, model, finish and usage (its own shape)."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.json()
    said: dict[str, Any] = {}
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[len("data: ") :])
        inner = event.get("response") or event.get("message") or event
        said.setdefault("id", inner.get("id"))
        if inner.get("usage"):
            said["usage"] = {**said.get("usage", {}), **inner["usage"]}
    return said


async def test_a_budgeted_streams_usage_is_in_its_trace_though_its_client_was_not_sent_it(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    """A key with a token budget asks the upstream for its usage chunk and keeps it from a
    client that did not ask: the trace reads it from the meter, not from the bytes sent."""
    from tests.api.test_auth import bearer, key_table

    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table(tokens_per_minute=10_000)],
            env=tracing_env(receiver),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
        assert response.status_code == 200
        assert '"usage"' not in response.text
        await flush(proxy)
    _, operation, _ = tree(receiver.of_trace(trace_of(response)))
    assert operation.attributes["gen_ai.usage.output_tokens"] == 5
    assert operation.attributes["gen_ai.usage.input_tokens"] > 0


async def test_every_streams_usage_is_in_its_trace_though_the_upstream_sent_none(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    """No key, no budget, a client that asked for no usage: Sluice meters every generating
    request (the fair scheduler counts its tokens), so its trace still reads what it used."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=4)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, env=tracing_env(receiver))
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body())
        assert response.status_code == 200
        assert '"usage"' not in response.text
        await flush(proxy)
    _, operation, _ = tree(receiver.of_trace(trace_of(response)))
    assert operation.attributes["gen_ai.usage.output_tokens"] == 4
    assert operation.attributes["gen_ai.usage.input_tokens"] > 0


@pytest.mark.parametrize("case", list(ENDPOINT_CASES))
async def test_the_operation_span_names_the_answer(
    nursery: trio.Nursery, receiver: Receiver, case: str
) -> None:
    path, body = ENDPOINT_CASES[case]
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=4)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, env=tracing_env(receiver))
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + path, json=body)
        assert response.status_code == 200, response.text
        await flush(proxy)
    _, operation, _ = tree(receiver.of_trace(trace_of(response)))
    attributes = operation.attributes
    said = _said(response)
    usage = said.get("usage") or {}
    if case != "embeddings":
        assert attributes["gen_ai.response.id"] == said["id"]
        assert attributes["gen_ai.response.finish_reasons"] == [FINISHED[case]], response.text
    assert attributes["gen_ai.response.model"]
    assert attributes["gen_ai.usage.input_tokens"] == usage.get(
        "prompt_tokens", usage.get("input_tokens")
    )
    if case != "embeddings":
        assert attributes["gen_ai.usage.output_tokens"] == usage.get(
            "completion_tokens", usage.get("output_tokens")
        )
    # No text without capture_content.
    assert "gen_ai.input.messages" not in attributes
    assert "gen_ai.output.messages" not in attributes


@pytest.mark.parametrize("stream", [True, False])
async def test_capture_content_records_the_prompt_and_the_answer(
    nursery: trio.Nursery, receiver: Receiver, stream: bool
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=4)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            env=tracing_env(receiver),
            tracing={"capture_content": True},
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body(stream=stream))
        assert response.status_code == 200
        await flush(proxy)
    _, operation, _ = tree(receiver.of_trace(trace_of(response)))
    prompt = json.loads(operation.attributes["gen_ai.input.messages"])
    assert prompt == [{"role": "user", "parts": [{"type": "text", "content": "hello there"}]}]
    (answer,) = json.loads(operation.attributes["gen_ai.output.messages"])
    if stream:
        text = "".join(
            json.loads(payload)["choices"][0]["delta"].get("content") or ""
            for payload in sse_payloads(response.text)
            if payload.startswith("{") and json.loads(payload)["choices"]
        )
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert text
    assert answer == {"role": "assistant", "parts": [{"type": "text", "content": text}]}


async def test_a_passthrough_path_has_the_same_tree(
    nursery: trio.Nursery, receiver: Receiver
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(
            nursery,
            {"fake-model": {"upstreams": [fake.url], "passthrough": ["/tokenize"]}},
            env=tracing_env(receiver),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "hello there"}
            )
        assert response.status_code == 200, response.text
        await flush(proxy)
    server, operation, (attempt,) = tree(receiver.of_trace(trace_of(response)))
    assert server.name == "POST /tokenize"
    assert operation.kind == KIND_CLIENT
    assert operation.attributes["sluice.endpoint"] == "passthrough"
    assert operation.attributes["sluice.outcome"] == "completed"
    assert attempt.attributes["sluice.outcome"] == "completed"
    assert fake.recorder.last().headers["traceparent"].split("-")[2] == attempt.span_id
