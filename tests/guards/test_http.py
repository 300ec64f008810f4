"""Guards through the whole server, on real sockets (127.0.0.1, port 0): the config's
start-up errors, the request stage's refusals and edits in each endpoint's shape, an output
regex guard against the fake upstream (the upstream closed at once), the access line and the
metrics, reload, the built-in webhook (a client that leaves leaves no request open to the
policy service) and model guards, and the example package of docs/guards.md."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from proxy.api.app import create_app
from proxy.api.state import state_of
from proxy.config import ConfigError, config_from_mapping, load_config
from proxy.guards import Outcome, Prompt, Refusal, Window
from proxy.server.run import serve
from tests.support import (
    DEADLINE,
    access_lines,
    chat_body,
    poll_until,
    read_request,
    sse_payloads,
    start_fake,
    start_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield


def table(**values: Any) -> dict[str, Any]:
    return {"name": "g", "use": "regex", "stage": "output", **values}


# -- guards this module serves (use = "tests.guards.test_http:...") --------------------------

SEEN: list[Any] = []


async def add_system_message(prompt: Prompt) -> dict[str, Any]:
    body = dict(prompt.body)
    body["messages"] = [{"role": "system", "content": "Be kind."}, *body["messages"]]
    return body


async def refuse_teapots(prompt: Prompt) -> Refusal | None:
    if "teapot" in prompt.text:
        return Refusal("no teapots", status=418, code="teapot", reason="asked for a teapot")
    return None


def two_arguments(a: object, b: object) -> None:  # not a guard
    pass


def failing_factory(options: dict[str, Any]) -> Any:
    raise ValueError("the factory says no")


async def remember(outcome: Outcome) -> None:
    SEEN.append(outcome)


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "says"),
    [
        (table(use="no_such_package.guards:check"), "cannot import 'no_such_package.guards'"),
        (table(use="tests.guards.test_http:nothing_here"), "has no 'nothing_here'"),
        (table(use="tests.guards.test_http:two_arguments"), "neither an async function"),
        (table(use="tests.guards.test_http:failing_factory"), "the factory says no"),
        (table(options={"deny": ["("]}), "deny pattern 1"),
        (table(options={"denied": ["x"]}), "unknown option 'denied'"),
        (table(use="webhook", options={"url": "ftp://x"}), "http:// or https://"),
        (table(use="model", options={"model": "nope"}), "does not serve"),
    ],
)
def test_a_guard_that_cannot_be_served_is_a_start_up_error_naming_it(
    guard: dict[str, Any], says: str
) -> None:
    config = config_from_mapping(
        {"models": {"m": {"upstreams": ["http://127.0.0.1:9"]}}, "guards": [guard]}, env={}
    )
    with pytest.raises(ConfigError, match="'g'") as raised:
        create_app(config, env={})
    assert says in str(raised.value)


def test_an_unknown_key_in_a_guards_table_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown key 'windows' in \\[\\[guards\\]\\] number 1"):
        config_from_mapping({"guards": [table(windows=3)]}, env={})
    with pytest.raises(ConfigError, match="'models' in \\[\\[guards\\]\\] 'g' names 'other'"):
        config_from_mapping(
            {"models": {"m": {"upstreams": ["http://x"]}}, "guards": [table(models=["other"])]},
            env={},
        )
    with pytest.raises(ConfigError, match="overlap_tokens"):
        config_from_mapping({"guards": [table(window_tokens=4, overlap_tokens=4)]}, env={})


# -- the stages over HTTP ---------------------------------------------------------------------


async def test_an_output_regex_guard_refuses_a_value_split_across_events(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.access")
    # The fake's answer: "The quick brown fox jumps over ...", one word an event.
    fake = await start_fake(nursery, ttft=0.02, interval=0.02, tokens=40)
    guard = table(window_tokens=4, overlap_tokens=3, options={"deny": [r"fox\s+jumps\s+over"]})
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=[guard])
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(proxy.url + CHAT, json=chat_body())
        await fake.recorder.wait_for(lambda r: r.last().outcome != "pending")
    payloads = sse_payloads(answer.text)
    assert answer.status_code == 200
    text = stream_text(payloads[:-1])
    assert "fox" not in text and "jumps" not in text
    assert json.loads(payloads[-1])["error"]["code"] == "guard_refused"
    # The upstream was closed at the verdict (window 2 closed at token 8): not run to 40.
    record = fake.recorder.last()
    assert record.outcome == "client_disconnected"
    assert record.tokens_sent <= 10
    (line,) = access_lines(caplog)
    assert (line["guard"], line["guard_reason"]) == ("g", "deny pattern 1 matched")
    assert line["outcome"] == "guard_refused"
    metrics = proxy.state.metrics.render()[0].decode()
    assert 'sluice_guard_decisions_total{guard="g",stage="output",verdict="refuse"} 1.0' in metrics
    assert 'sluice_guard_decisions_total{guard="g",stage="output",verdict="pass"} 1.0' in metrics
    assert 'sluice_guard_seconds_count{guard="g",stage="output"} 2.0' in metrics


async def test_a_refused_responses_stream_numbers_its_error_after_the_last_event_sent(
    nursery: trio.Nursery,
) -> None:
    # Windows held and released, then one refused: its events are dropped, and the in-band
    # error follows the last number the client got (not 0, not the upstream's next).
    fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=40)
    guard = table(window_tokens=4, overlap_tokens=2, options={"deny": [r"fox\s+jumps"]})
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=[guard])
    body = {"model": "fake-model", "input": "hello", "stream": True}
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(proxy.url + "/v1/responses", json=body)
    events = [
        json.loads(line[len("data: ") :])
        for line in answer.text.splitlines()
        if line.startswith("data: ")
    ]
    numbers = [event["sequence_number"] for event in events]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "guard_refused"
    assert any(event["type"] == "response.output_text.delta" for event in events)
    assert numbers == list(range(len(numbers)))


async def test_a_request_guard_refuses_in_the_endpoints_own_shape(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.access")
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
    guard = table(stage="request", use="tests.guards.test_http:refuse_teapots")
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=[guard])
    asked = [{"role": "user", "content": "a teapot please"}]
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            openai = await client.post(proxy.url + CHAT, json=chat_body(messages=asked))
            anthropic = await client.post(
                proxy.url + "/v1/messages",
                json={"model": "fake-model", "max_tokens": 5, "messages": asked},
            )
            passed = await client.post(proxy.url + CHAT, json=chat_body(stream=False))
    assert openai.status_code == anthropic.status_code == 418
    assert openai.json()["error"]["code"] == "teapot"
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["message"] == "no teapots"
    assert passed.status_code == 200
    # Refused before the queue: the upstream saw only the request that passed.
    assert len(fake.recorder.records) == 1
    # The refused requests' lines and metric name the model they asked for (the body was
    # parsed before the guard ran), as the guard and its reason.
    refusals = [line for line in access_lines(caplog) if line["status"] == 418]
    assert [(line["model"], line["guard"]) for line in refusals] == [("fake-model", "g")] * 2
    assert refusals[0]["guard_reason"] == "asked for a teapot"
    metrics = proxy.state.metrics.render()[0].decode()
    assert 'sluice_requests_total{endpoint="chat",key="-",model="fake-model",status="418"}' in (
        metrics
    )


async def test_a_request_guard_edits_the_body_the_upstream_gets(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
    guard = table(stage="request", use="tests.guards.test_http:add_system_message")
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=[guard])
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(proxy.url + CHAT, json=chat_body(stream=False))
    assert answer.status_code == 200
    sent = fake.recorder.last().body
    assert sent["messages"][0] == {"role": "system", "content": "Be kind."}


async def test_guards_apply_to_their_models_and_keys_only(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
    guard = table(stage="request", models=["guarded"], options={"deny": ["hello"]})
    proxy = await start_proxy(nursery, {"guarded": [fake.url], "open": [fake.url]}, guards=[guard])
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            guarded = await client.post(proxy.url + CHAT, json=chat_body("guarded"))
            open_ = await client.post(proxy.url + CHAT, json=chat_body("open"))
    assert guarded.status_code == 400 and open_.status_code == 200


async def test_a_reload_rebuilds_the_guards(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
    path = tmp_path / "sluice.toml"
    base = f'[server]\nport = 0\n[models.fake-model]\nupstreams = ["{fake.url}"]\n'
    path.write_text(base)
    config = load_config(path, env={})
    app = create_app(config, env={})
    (url,) = await nursery.start(serve, app, config)
    state = state_of(app)
    guard = '[[guards]]\nname = "hi"\nuse = "regex"\nstage = "request"\n'
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.post(url + CHAT, json=chat_body())).status_code == 200
            path.write_text(base + guard + '[guards.options]\ndeny = ["hello"]\n')
            assert await state.reload_config() == "applied"
            assert (await client.post(url + CHAT, json=chat_body())).status_code == 400
            # A guard that cannot be served: the reload is refused, the guards as they were.
            path.write_text(base + guard.replace('"regex"', '"nowhere.at_all:g"'))
            assert await state.reload_config() == "invalid"
            assert (await client.post(url + CHAT, json=chat_body())).status_code == 400


# -- the built-ins ----------------------------------------------------------------------------


class PolicyService:
    """A policy service on 127.0.0.1 that counts its open connections and answers each
    request after ``delay`` seconds (forever: never) with ``allow``."""

    def __init__(self, delay: float, allow: bool = True) -> None:
        self.delay = delay
        self.allow = allow
        self.open = 0
        self.requests: list[dict[str, Any]] = []

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        task_status.started(f"http://127.0.0.1:{port}/check")
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.open += 1
        try:
            request = await read_request(stream)
            if request is None:
                return
            _, body = request
            self.requests.append(json.loads(body))
            with trio.move_on_after(self.delay):
                # Waits, reading, so that a client's close is seen at once.
                while await stream.receive_some(1):
                    pass
                return
            answer = json.dumps({"allow": self.allow, "reason": "policy 7"}).encode()
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(answer)}\r\nconnection: close\r\n\r\n".encode()
                + answer
            )
        finally:
            self.open -= 1
            await stream.aclose()


async def test_a_client_that_leaves_leaves_no_request_open_to_the_policy_service(
    nursery: trio.Nursery,
) -> None:
    service = PolicyService(delay=float("inf"))
    url = await nursery.start(service.serve)
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=5)
    guard = table(stage="prompt", use="webhook", timeout=30.0, options={"url": url})
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=[guard])
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as posting:
            posting.start_soon(partial(client.post, proxy.url + CHAT, json=chat_body()))
            # The client leaves once the policy service has the request, however long that took.
            await poll_until(lambda: service.requests)
            posting.cancel_scope.cancel()
        assert service.requests[0]["stage"] == "prompt"
        assert "hello there" in service.requests[0]["text"]
        # The client is gone: the webhook's request was cancelled and its connection closed.
        await poll_until(lambda: service.open == 0)
        await poll_until(lambda: not proxy.state.tracker.active)


async def test_a_webhook_that_denies_refuses_with_its_reason(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.access")
    service = PolicyService(delay=0.0, allow=False)
    url = await nursery.start(service.serve)
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=5)
    guard = table(stage="request", use="webhook", options={"url": url})
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=[guard])
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(proxy.url + CHAT, json=chat_body())
    assert answer.status_code == 400
    (line,) = access_lines(caplog)
    assert line["guard_reason"] == "policy 7"


async def test_a_model_guard_asks_a_served_model(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, ttft=0.01, interval=0.0, tokens=4)
    models = {
        "fake-model": [fake.url],
        "judge": {"upstreams": [fake.url], "upstream_model": "fake-model"},
    }
    # The fake judge answers "The quick brown fox": refused when the pattern reads "^The".
    refusing = table(stage="prompt", use="model", options={"model": "judge", "refuse": "^The"})
    passing = table(name="h", stage="prompt", use="model", options={"model": "judge"})
    for guards, status in (([refusing], 400), ([passing], 200)):
        proxy = await start_proxy(nursery, models, guards=guards)
        with trio.fail_after(DEADLINE):
            async with httpx.AsyncClient(timeout=10) as client:
                answer = await client.post(proxy.url + CHAT, json=chat_body())
        assert answer.status_code == status, answer.text
    judged = [
        r for r in fake.recorder.records if "Is the following text safe" in json.dumps(r.body)
    ]
    assert len(judged) == 2


async def test_a_model_guard_judges_each_output_window(nursery: trio.Nursery) -> None:
    """At the output stage the model guard asks its model about each window's text: refused,
    nothing of the answer goes out (its first window held until judged) and it is asked once;
    passed, all of it goes out, the last window judged with the answer's end."""
    fake = await start_fake(nursery, ttft=0.01, interval=0.02, tokens=6)
    models = {
        "fake-model": [fake.url],
        "judge": {"upstreams": [fake.url], "upstream_model": "fake-model"},
    }
    # The fake judge answers "The quick brown fox": refused when the pattern reads "^The".
    window = {"window_tokens": 4, "overlap_tokens": 1}
    refusing = table(use="model", options={"model": "judge", "refuse": "^The"}, **window)
    passing = table(name="h", use="model", options={"model": "judge"}, **window)
    answers, judged = [], []
    for guards in ([refusing], [passing]):
        proxy = await start_proxy(nursery, models, guards=guards)
        since = len(fake.recorder.records)
        with trio.fail_after(DEADLINE):
            async with httpx.AsyncClient(timeout=10) as client:
                answers.append(await client.post(proxy.url + CHAT, json=chat_body()))
        asked = [json.dumps(r.body) for r in fake.recorder.records[since:]]
        judged.append([body for body in asked if "Is the following text safe" in body])
    refused, passed = answers
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "guard_refused"
    assert len(judged[0]) == 1 and "The quick" in judged[0][0]
    assert passed.status_code == 200
    assert stream_text(sse_payloads(passed.text)) == "The quick brown fox jumps over "
    assert judged[1] and "over" in judged[1][-1]


async def test_a_request_refused_at_the_request_stage_still_has_its_after_hooks(
    nursery: trio.Nursery,
) -> None:
    SEEN.clear()
    fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
    guards = [
        table(stage="request", use="tests.guards.test_http:refuse_teapots"),
        table(name="audit", stage="after", use="tests.guards.test_http:remember"),
    ]
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=guards)
    asked = [{"role": "user", "content": "a teapot please"}]
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(proxy.url + CHAT, json=chat_body(messages=asked))
        await poll_until(lambda: len(SEEN) == 1)
    assert answer.status_code == 418
    (outcome,) = SEEN
    assert (outcome.guard, outcome.status, outcome.outcome) == ("audit", 418, "teapot")
    assert (outcome.refused_by, outcome.refused_reason) == ("g", "asked for a teapot")
    assert outcome.ttft is None and outcome.model == "fake-model"
    assert len(fake.recorder.records) == 0  # refused before the queue


# -- the example package of docs/guards.md ----------------------------------------------------


async def test_the_example_package_redacts_addresses_and_writes_usage(
    nursery: trio.Nursery, tmp_path: Path, example_path: None
) -> None:
    usage = tmp_path / "usage.jsonl"
    fake = await start_fake(nursery, ttft=0.01, interval=0.0, tokens=6)
    guards: list[dict[str, Any]] = [
        {
            "name": "redact-email",
            "use": "my_guards:redact_emails",
            "stage": "output",
            "window_tokens": 16,
            "overlap_tokens": 4,
        },
        {
            "name": "usage-log",
            "use": "my_guards:usage_file",
            "stage": "after",
            "options": {"path": str(usage)},
        },
    ]
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, guards=guards)
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(proxy.url + CHAT, json=chat_body())
        await poll_until(lambda: usage.exists() and usage.read_text().count("\n") == 1)
    assert stream_text(sse_payloads(answer.text)) == "The quick brown fox jumps over "
    (line,) = [json.loads(text) for text in usage.read_text().splitlines()]
    assert line["status"] == 200 and line["output_tokens"] == 6
    from my_guards import redact_emails

    window = Window(
        "g", "r", "chat", "m", None, "mail bob@example.com", "mail bob@example.com", 0, True
    )
    assert await redact_emails(window) == "mail [email]"
