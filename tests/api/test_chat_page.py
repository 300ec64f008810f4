"""The chat page (``proxy/api/web.py``, ``proxy/api/static/``) in a real headless Chromium.

The proxy runs in the test's trio nursery (real hypercorn on 127.0.0.1:0); the browser is driven
by Playwright's sync API in a worker thread (``trio.to_thread.run_sync``: Playwright runs its own
asyncio loop there), which calls back into trio (``trio.from_thread``) to look at the server
while the page streams. Playwright's own timeouts bound every browser step, so the thread always
returns; the trio side runs under ``fail_after`` as usual. Where a test needs to write the
answer itself (Markdown arriving a piece at a time, hostile HTML, a finish reason), the page's
fetch for the chat endpoint is swapped for a stream the test pushes into (``FakeChat``).

Needs Playwright (the ``dev`` extra) and a Chromium at ``/usr/bin/chromium`` (or
``$SLUICE_CHROMIUM``); Playwright's own browser downloads are never used. Without either, the
browser tests skip and say why.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx
import pytest
import trio

from proxy.api import web
from proxy.api.app import create_app
from proxy.api.auth import hash_key
from proxy.config import config_from_mapping
from proxy.server.run import serve
from tests.support import DEADLINE, Proxy, RawClient, chat_body, slowed, start_fake

if TYPE_CHECKING:
    from playwright.sync_api import Dialog, Page, Request, Route, ViewportSize

T = TypeVar("T")

CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT: ViewportSize = {"width": 1000, "height": 700}
# Every Playwright wait gives up after this (ms), so the browser thread always returns.
BROWSER_TIMEOUT_MS = 10_000
CHAT = "/v1/chat/completions"
STATIC = Path(web.__file__).parent / "static"


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[dev]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set SLUICE_CHROMIUM)"
    return None


_MISSING = _browser_missing()
needs_browser = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def local_model(**overrides: Any) -> dict[str, Any]:
    return {"backend": "local", "path": "unused-preloaded", "default_temperature": 0.0, **overrides}


async def serve_page(
    nursery: trio.Nursery,
    models: dict[str, Any],
    *,
    local_models: dict[str, Any] | None = None,
    keys: list[dict[str, Any]] | None = None,
) -> Proxy:
    """As ``tests.support.start_proxy``, with the page's blueprint registered (when app.py does
    not register it itself)."""
    data: dict[str, Any] = {"server": {"port": 0}}
    if keys is not None:
        data["keys"] = keys
    data["models"] = {
        name: {"upstreams": spec} if isinstance(spec, list) else spec
        for name, spec in models.items()
    }
    config = config_from_mapping(data, "test", env={})
    app = create_app(config, env={}, local_models=local_models)
    if web.blueprint.name not in app.blueprints:
        app.register_blueprint(web.blueprint)
    binds = await nursery.start(serve, app, config)
    return Proxy(binds[0], app, config)


def in_browser(
    url: str,
    script: Callable[[Page], T],
    *,
    viewport: ViewportSize = VIEWPORT,
    color_scheme: Literal["light", "dark"] = "light",
    setup: Callable[[Page], None] | None = None,
) -> T:
    """Open ``url`` in a fresh headless Chromium and run ``script(page)``; runs in a thread.
    ``setup(page)`` runs before the page is opened (to route requests). Fails on any script
    error in the page, on any dialog it opens, and on any request that leaves ``url``'s
    origin."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=BROWSER_TIMEOUT_MS)
    page_errors: list[str] = []
    foreign: list[str] = []
    dialogs: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=viewport, color_scheme=color_scheme)
            context.set_default_timeout(BROWSER_TIMEOUT_MS)
            page = context.new_page()
            page.on("pageerror", lambda error: page_errors.append(str(error)))

            def on_dialog(dialog: Dialog) -> None:
                dialogs.append(dialog.message)
                dialog.dismiss()

            page.on("dialog", on_dialog)

            def check_origin(request: Request) -> None:
                if not request.url.startswith((url, "data:")):
                    foreign.append(request.url)

            page.on("request", check_origin)
            if setup is not None:
                setup(page)
            page.goto(url + "/")
            page.wait_for_function("window.sluiceChat && window.sluiceChat.ready !== null")
            page.evaluate("window.sluiceChat.ready")  # waits for the model list
            result = script(page)
        finally:
            browser.close()
    assert page_errors == []
    assert dialogs == []
    assert foreign == []
    return result


async def run_in_browser(url: str, script: Callable[[Page], T], **options: Any) -> T:
    return await trio.to_thread.run_sync(partial(in_browser, url, script, **options))


def is_subsequence(needle: str, haystack: str) -> bool:
    rest = iter(haystack)
    return all(char in rest for char in needle)


def on_trio(fn: Callable[[], T]) -> T:
    """Run ``fn`` in the test's trio thread (from the browser thread) and return its result."""
    return trio.from_thread.run_sync(fn)


# -- the page itself, over plain HTTP ----------------------------------------------------------


async def test_page_and_assets_are_served_from_the_package(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
        proxy = await serve_page(nursery, {"fake-model": [fake.url]})
        async with httpx.AsyncClient(base_url=proxy.url, trust_env=False) as client:
            for path, (name, content_type) in web.ASSETS.items():
                response = await client.get(path)
                assert response.status_code == 200, path
                assert response.headers["content-type"] == content_type
                assert response.content == (STATIC / name).read_bytes()
                csp = response.headers["content-security-policy"]
                assert "default-src 'none'" in csp and "connect-src 'self'" in csp
                assert response.headers["x-content-type-options"] == "nosniff"
                etag = response.headers["etag"]
                again = await client.get(path, headers={"If-None-Match": etag})
                assert (again.status_code, again.content) == (304, b"")
            # Exactly these files: nothing else under /static, no directory listing.
            for path in ("/static/", "/static/index.html", "/static/../app.py", "/web.py"):
                assert (await client.get(path)).status_code == 404, path
            # The API beside it is untouched.
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "fake-model"


def test_static_files_reference_nothing_outside_the_origin() -> None:
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "@import" not in text and "url(" not in text, name
    html = (STATIC / "index.html").read_text()
    # Paths are relative, so the page also works behind a reverse proxy's path prefix.
    assert 'src="static/app.js"' in html and 'href="static/style.css"' in html
    assert "<script>" not in html and "style=" not in html  # nothing inline: the CSP forbids it


# -- in the browser ----------------------------------------------------------------------------


@needs_browser
async def test_stream_stop_and_a_second_turn(
    nursery: trio.Nursery, tiny_loaded_model: Any, tmp_path: Path
) -> None:
    """Text streams in; Stop closes the fetch, and the server frees the model within a step."""
    step = 0.05
    loaded = slowed(tiny_loaded_model, step)
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_page(nursery, {"tiny": local_model()}, local_models={"tiny": loaded})
        backend = proxy.state.local_backends["tiny"]
        report: dict[str, Any] = {}

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            model = page.get_by_label("Model", exact=True)
            expect(model).to_have_value("tiny")
            model.select_option("tiny")
            page.get_by_label("Message", exact=True).fill("Tell me a long story.")
            page.get_by_role("button", name="Send").click()
            expect(page.get_by_role("button", name="Stop")).to_be_enabled()
            answer = page.locator("article.assistant .text").last
            # The answer area grows over several observations while the model generates.
            lengths = [0]
            while len(set(lengths)) < 3:
                page.wait_for_timeout(80)
                lengths.append(len(answer.text_content() or ""))
                assert len(lengths) < 100, lengths
            assert lengths == sorted(lengths)
            report["lengths"] = lengths
            expect(page.get_by_role("status")).to_contain_text("tokens/s")
            expect(page.get_by_role("status")).to_contain_text("first token")
            assert on_trio(lambda: backend.active_generations) == 1

            report["steps_at_stop"] = on_trio(lambda: loaded.model.steps)
            clicked = time.monotonic()
            page.get_by_role("button", name="Stop").click()
            trio.from_thread.run(backend.admission.wait_free)
            report["click_to_free"] = time.monotonic() - clicked
            report["steps_after"] = on_trio(lambda: loaded.model.steps)
            expect(page.get_by_role("status")).to_contain_text("Stopped")
            expect(page.locator("article.assistant .meta").last).to_contain_text("Stopped")
            expect(page.get_by_role("button", name="Stop")).to_be_disabled()
            shown = answer.text_content() or ""
            assert len(shown) >= lengths[-1]
            # What was received, as Markdown source: every visible character is in it, in order
            # (rendering only takes syntax away), and it is what the next request carries.
            stopped_text = page.evaluate("sluiceChat.lastTurn.text")
            assert is_subsequence("".join(shown.split()), stopped_text), (shown, stopped_text)

            # A second turn, sent with the keyboard; it carries the first (cut-short) answer.
            page.get_by_label("Max tokens").fill("6")
            box = page.get_by_label("Message", exact=True)
            box.fill("And")
            box.press("Shift+Enter")  # a new line, not a send
            box.press_sequentially("then?")
            assert box.input_value() == "And\nthen?"
            with page.expect_request(lambda r: r.url.endswith(CHAT)) as sent:
                box.press("Enter")
            body = json.loads(sent.value.post_data or "")
            assert body["stream"] is True
            assert body["stream_options"] == {"include_usage": True}
            assert body["max_tokens"] == 6
            assert body["messages"] == [
                {"role": "user", "content": "Tell me a long story."},
                {"role": "assistant", "content": stopped_text},
                {"role": "user", "content": "And\nthen?"},
            ]
            expect(page.get_by_role("status")).to_contain_text("Done", timeout=5000)
            last_meta = page.locator("article.assistant .meta").last
            expect(last_meta).to_contain_text("6 tokens")  # from the usage chunk
            expect(last_meta).to_contain_text("tokens/s")
            # It stopped at max_tokens (finish_reason "length"), and says so.
            expect(last_meta).to_contain_text("Cut off at the max tokens limit")
            expect(page.get_by_role("alert")).to_be_hidden()
            assert page.locator("#conversation").get_attribute("aria-busy") == "false"
            report["screenshot"] = tmp_path / "chat-page.png"
            page.screenshot(path=report["screenshot"])

        await run_in_browser(proxy.url, script)

        # The server saw the page leave: the relay was cancelled mid-stream, and the model
        # stopped within about one decode step of the disconnect.
        await backend.admission.wait_free()
        assert backend.active_generations == 0
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.cancelled == 1
        registry = proxy.state.metrics.registry
        labels = {"backend": "local", "phase": "mid_stream"}
        assert registry.get_sample_value("sluice_cancellations_total", labels) == 1
        propagation = registry.get_sample_value(
            "sluice_cancel_propagation_seconds_sum", {"backend": "local"}
        )
        assert propagation is not None and 0 < propagation < step + 0.1, propagation
        # Click to free: the browser's abort, the TCP close, then at most the step in progress.
        assert report["steps_after"] - report["steps_at_stop"] <= 2, report
        assert report["click_to_free"] < 1.0, report
        assert report["screenshot"].stat().st_size > 10_000


@needs_browser
async def test_a_busy_model_is_told_in_words(nursery: trio.Nursery, tiny_loaded_model: Any) -> None:
    """429 from the local model's full queue: 'the model is busy, try again in N s'."""
    loaded = slowed(tiny_loaded_model, 0.02)
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_page(
            nursery,
            {"tiny": local_model(slots=1, max_queue=0)},
            local_models={"tiny": loaded},
        )
        backend = proxy.state.local_backends["tiny"]
        holder = await RawClient.post(proxy, CHAT, chat_body("tiny"))
        await holder.read_until(b'"content":"')

        def script(page: Page) -> str:
            from playwright.sync_api import expect

            expect(page.get_by_label("Model", exact=True)).to_have_value("tiny")
            box = page.get_by_label("Message", exact=True)
            box.fill("Hello?")
            box.press("Enter")
            alert = page.get_by_role("alert")
            expect(alert).to_contain_text(re.compile(r"The model is busy, try again in \d+ s\."))
            # The turn is taken back and the draft returned, ready to send again.
            expect(box).to_have_value("Hello?")
            assert page.locator("article").count() == 0
            expect(page.get_by_role("button", name="Send")).to_be_enabled()
            return alert.text_content() or ""

        text = await run_in_browser(proxy.url, script)
        assert "queue" in text.lower()  # the server's own message follows, in brackets
        await holder.close()
        await backend.admission.wait_free()
        registry = proxy.state.metrics.registry
        assert registry.get_sample_value(
            "sluice_requests_total",
            {"model": "tiny", "status": "429", "endpoint": "chat", "key": "-"},
        )


def _sse(*events: dict[str, Any] | str) -> str:
    return "".join(
        f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n" for event in events
    )


def _chunk(content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "model": "fake-model",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }


# Counts the reads of any response body that brought data (window.readsWithData), from now on.
COUNT_READS = """
() => {
  const read = ReadableStreamDefaultReader.prototype.read;
  window.readsWithData = 0;
  ReadableStreamDefaultReader.prototype.read = function () {
    return read.call(this).then((result) => {
      if (!result.done) window.readsWithData += 1;
      return result;
    });
  };
}
"""


# The SSE parser against every split of a stream: CRLF and LF framing, multi-line data,
# comments, multi-byte characters split between reads. Runs in the page.
PARSER_CHECK = """
() => {
  const stream = 'data: {"a":"h\\u00e9llo \\u4e16\\u754c \\ud83d\\ude00"}\\r\\n\\r\\n'
    + ': a comment\\n\\n'
    + 'event: message\\ndata: line one\\ndata: line two\\n\\n'
    + 'data: [DONE]\\n\\n';
  const bytes = new TextEncoder().encode(stream);
  const expected = ['{"a":"h\\u00e9llo \\u4e16\\u754c \\ud83d\\ude00"}', 'line one\\nline two',
                    '[DONE]'];
  const failures = [];
  for (let i = 0; i <= bytes.length; i++) {
    for (let j = i; j <= bytes.length; j += 7) {
      const parser = new window.sluiceChat.SSEParser();
      const decoder = new TextDecoder();
      const got = [];
      for (const part of [bytes.slice(0, i), bytes.slice(i, j), bytes.slice(j)]) {
        got.push(...parser.push(decoder.decode(part, {stream: true})));
      }
      got.push(...parser.push(decoder.decode()));
      if (JSON.stringify(got) !== JSON.stringify(expected)) failures.push([i, j, got]);
    }
  }
  return failures.slice(0, 3);
}
"""


@needs_browser
async def test_errors_are_shown_in_words(nursery: trio.Nursery) -> None:
    """HTTP errors with OpenAI bodies, in-band errors mid-stream, a stream cut short, the
    network failing; also batching: a burst of tokens is drawn in one frame, not one by one."""
    with trio.fail_after(DEADLINE + 10):
        fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
        proxy = await serve_page(nursery, {"fake-model": [fake.url]})

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            assert page.evaluate(PARSER_CHECK) == []
            responses: list[Callable[[Route], None]] = []
            page.route("**" + CHAT, lambda route: responses.pop(0)(route))
            alert = page.get_by_role("alert")
            box = page.get_by_label("Message", exact=True)

            def ask(answer: Callable[[Route], None], question: str = "Hi") -> None:
                responses.append(answer)
                box.fill(question)
                box.press("Enter")

            def fulfill(status: int, body: str, **headers: str) -> Callable[[Route], None]:
                content_type = "text/event-stream" if status == 200 else "application/json"
                return lambda route: route.fulfill(
                    status=status, body=body, headers={"Content-Type": content_type, **headers}
                )

            expect(page.get_by_label("Model", exact=True)).to_have_value("fake-model")
            error_body = {"error": {"message": "Upstream said no.", "type": "x", "code": None}}
            ask(fulfill(502, json.dumps(error_body)))
            expect(alert).to_have_text("The server answered 502: Upstream said no.")

            ask(fulfill(503, json.dumps(error_body), **{"Retry-After": "7"}))
            expect(alert).to_contain_text("The model is busy, try again in 7 s.")

            ask(fulfill(500, "<html>oops</html>"))
            expect(alert).to_contain_text("The server answered 500: <html>oops</html>")

            ask(lambda route: route.abort("connectionrefused"))
            expect(alert).to_contain_text("Could not reach the server")

            in_band = {"error": {"message": "upstream_idle_timeout: no token for 30 s"}}
            ask(fulfill(200, _sse(_chunk("Half "), _chunk("an answer"), in_band)))
            expect(alert).to_have_text(
                "The answer stopped with an error: upstream_idle_timeout: no token for 30 s"
            )
            assistant = page.locator("article.assistant").last
            expect(assistant.locator(".text")).to_have_text("Half an answer")
            expect(assistant.locator(".meta")).to_contain_text("Interrupted")

            ask(fulfill(200, _sse(_chunk("No end"))))
            expect(alert).to_contain_text("The stream ended before the answer was complete.")

            # A burst: 300 tokens in one answer are drawn once per frame at most, not once per
            # token: no more renders than the reads that brought them (one or two; a loaded
            # machine may hand the body over in more, each in its own frame). The page's reads
            # are counted here.
            page.evaluate(COUNT_READS)
            tokens = [f"t{i} " for i in range(300)]
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 300}}
            ask(fulfill(200, _sse(*map(_chunk, tokens), usage, "[DONE]")))
            expect(page.get_by_role("status")).to_contain_text("Done")
            expect(alert).to_be_hidden()
            expect(page.locator("article.assistant .text").last).to_have_text("".join(tokens))
            turn = page.evaluate(
                "({r: sluiceChat.lastTurn.renders, c: sluiceChat.lastTurn.chunks,"
                " reads: window.readsWithData})"
            )
            assert turn["c"] == 300 and 1 <= turn["r"] <= turn["reads"], turn
            # A burst it was: fewer reads than tokens, so a render per token would have failed.
            assert turn["reads"] < turn["c"], turn
            expect(page.locator("article.assistant .meta").last).to_contain_text("300 tokens")

            # The real server behind the page again, end to end.
            page.unroute("**" + CHAT)
            page.get_by_role("button", name="New chat").click()
            assert page.locator("article").count() == 0
            box.fill("Hello")
            box.press("Enter")
            expect(page.get_by_role("status")).to_contain_text("Done")
            expect(page.locator("article.assistant .text")).to_have_text("The quick brown ")

        await run_in_browser(proxy.url, script)


@needs_browser
async def test_api_key_is_sent_and_remembered(nursery: trio.Nursery) -> None:
    secret = "sk-page-test"
    with trio.fail_after(DEADLINE + 10):
        fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=2)
        proxy = await serve_page(
            nursery,
            {"fake-model": [fake.url]},
            keys=[{"name": "page", "sha256": hash_key(secret)}],
        )

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            alert = page.get_by_role("alert")
            expect(alert).to_contain_text("The server needs an API key")
            key = page.get_by_label("API key")
            key.fill(secret)
            key.press("Tab")  # "change": stored, and the model list asked for again
            expect(page.get_by_label("Model", exact=True)).to_have_value("fake-model")
            expect(alert).to_be_hidden()
            assert page.evaluate("localStorage.getItem('sluice.apiKey')") == secret
            page.reload()
            expect(page.get_by_label("API key")).to_have_value(secret)
            expect(page.get_by_label("Model", exact=True)).to_have_value("fake-model")
            with page.expect_request(lambda r: r.url.endswith(CHAT)) as sent:
                box = page.get_by_label("Message", exact=True)
                box.fill("Hi")
                box.press("Enter")
            assert sent.value.headers["authorization"] == f"Bearer {secret}"
            expect(page.get_by_role("status")).to_contain_text("Done")

        await run_in_browser(proxy.url, script)
        assert len(fake.recorder.records) == 1


def _finish(reason: str, **usage: int) -> dict[str, Any]:
    event: dict[str, Any] = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "model": "fake-model",
        "choices": [{"index": 0, "delta": {}, "finish_reason": reason}],
    }
    if usage:
        event["usage"] = usage
    return event


# -- the page against a stream the test writes -------------------------------------------------

# Replaces the page's fetch for the chat endpoint only: each request is recorded
# (fakeChat.requests) and answered at once with a stream whose bytes the test pushes
# (fakeChat.push), token by token if it likes; Stop aborts it as it would a real one.
FAKE_CHAT = """
() => {
  const realFetch = window.fetch.bind(window);
  const fake = { requests: [], streams: [] };
  window.fakeChat = fake;
  fake.push = (text) => fake.streams[fake.streams.length - 1].push(text);
  fake.end = () => fake.streams[fake.streams.length - 1].end();
  window.fetch = (resource, init) => {
    if (!String(resource).endsWith("v1/chat/completions")) return realFetch(resource, init);
    fake.requests.push(JSON.parse(init.body));
    let controller;
    const body = new ReadableStream({ start(c) { controller = c; } });
    const encoder = new TextEncoder();
    const stream = {
      aborted: false,
      push(text) { controller.enqueue(encoder.encode(text)); },
      end() { controller.close(); },
    };
    init.signal.addEventListener("abort", () => {
      stream.aborted = true;
      try { controller.error(new DOMException("aborted", "AbortError")); } catch (_) {}
    });
    fake.streams.push(stream);
    return Promise.resolve(new Response(body, {
      status: 200, headers: { "Content-Type": "text/event-stream" },
    }));
  };
}
"""


class FakeChat:
    """The page's side of FAKE_CHAT, from the test."""

    def __init__(self, page: Page) -> None:
        self.page = page
        page.evaluate(FAKE_CHAT)

    def ask(self, text: str) -> dict[str, Any]:
        """Send ``text`` from the composer; returns the request body the page sent."""
        count = self.page.evaluate("fakeChat.requests.length")
        box = self.page.get_by_label("Message", exact=True)
        box.fill(text)
        box.press("Enter")
        self.page.wait_for_function(f"fakeChat.requests.length === {count + 1}")
        body: dict[str, Any] = self.page.evaluate("fakeChat.requests.at(-1)")
        return body

    def push(self, *events: dict[str, Any] | str) -> None:
        self.page.evaluate("text => fakeChat.push(text)", _sse(*events))

    def text(self, text: str, pieces: int = 1) -> None:
        """Stream ``text`` as ``pieces`` chunks, a frame or so apart."""
        size = max(1, -(-len(text) // pieces))
        for start in range(0, len(text), size):
            self.push(_chunk(text[start : start + size]))
            self.page.wait_for_timeout(20)

    def done(self, reason: str = "stop", **usage: int) -> None:
        self.push(_finish(reason, **usage), "[DONE]")
        self.page.evaluate("fakeChat.end()")
        from playwright.sync_api import expect

        expect(self.page.get_by_role("status")).to_contain_text("Done")

    def answer(self, text: str, pieces: int = 1, reason: str = "stop") -> None:
        self.text(text, pieces)
        self.done(reason)


async def serve_fake_page(nursery: trio.Nursery, **fake: Any) -> Proxy:
    upstream = await start_fake(nursery, **{"ttft": 0.01, "interval": 0.01, "tokens": 3, **fake})
    return await serve_page(nursery, {"fake-model": [upstream.url]})


def test_vendored_libraries_are_the_pinned_ones() -> None:
    """marked and DOMPurify: byte for byte what scripts/vendor_js.py fetched (MANIFEST.json,
    from tarballs whose sha512 matched the pinned npm integrity), with their licences; served,
    and loaded before the page's script."""
    vendor = STATIC / "vendor"
    manifest = json.loads((vendor / "MANIFEST.json").read_text())
    assert set(manifest) == {"marked", "dompurify"}
    listed: set[str] = {"MANIFEST.json"}
    for name, entry in manifest.items():
        assert entry["integrity"].startswith("sha512-"), name
        assert entry["tarball"].startswith(f"https://registry.npmjs.org/{name}/-/"), name
        assert any("LICENSE" in target for target in entry["files"]), name
        for target, info in entry["files"].items():
            data = (vendor / target).read_bytes()
            assert hashlib.sha256(data).hexdigest() == info["sha256"], target
            listed.add(target)
    assert {path.name for path in vendor.iterdir()} == listed
    assert f"marked v{manifest['marked']['version']}" in (vendor / "marked.umd.js").read_text()
    assert f"DOMPurify {manifest['dompurify']['version']}" in (vendor / "purify.min.js").read_text()
    served = {name for name, _ in web.ASSETS.values()}
    assert {"vendor/marked.umd.js", "vendor/purify.min.js"} <= served
    html = (STATIC / "index.html").read_text()
    order = [
        html.index(f'src="static/{name}"')
        for name in ("vendor/marked.umd.js", "vendor/purify.min.js", "app.js")
    ]
    assert order == sorted(order)


@needs_browser
async def test_markdown_and_code_blocks_render_while_streaming(nursery: trio.Nursery) -> None:
    """A fenced code block is a <pre><code> from its opening fence on, while it streams and
    after; headings, bold, paragraphs; Copy on the code block and on the answer."""
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_fake_page(nursery)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=proxy.url)
            chat = FakeChat(page)
            chat.ask("Show me code")
            answer = page.locator("article.assistant").last
            text = answer.locator(".text")
            chat.text("# Reversing\n\nHere is **one** way:\n\n```py", pieces=4)
            chat.text("thon\ndef rev(s):\n")
            code = text.locator("pre > code")
            expect(code).to_contain_text("def rev(s):")
            assert "streaming" in (answer.get_attribute("class") or "")
            assert code.get_attribute("class") == "language-python"
            expect(text.locator("h3")).to_have_text("Reversing")
            expect(text.locator("p strong")).to_have_text("one")
            chat.text("    return s[::-1]\n")
            expect(code).to_contain_text("return s[::-1]")
            assert code.count() == 1  # the same block, grown; not one per frame
            chat.text("```\n\nThat is `all`.\n")
            chat.done(completion_tokens=12)
            expect(answer).not_to_have_class(re.compile("streaming"))
            source = "def rev(s):\n    return s[::-1]\n"
            assert (code.text_content() or "").rstrip("\n") == source.rstrip("\n")
            expect(text.locator("p").last).to_have_text("That is all.")
            expect(text.locator("p code")).to_have_text("all")
            assert "Copy" not in (text.text_content() or "")  # button labels are not text
            expect(answer.locator(".code-head")).to_have_attribute("data-lang", "python")

            answer.get_by_role("button", name="Copy code").click()
            expect(answer.get_by_role("button", name="Copied")).to_be_visible()
            copied = page.evaluate("navigator.clipboard.readText()")
            assert copied.rstrip("\n") == source.rstrip("\n")
            answer.get_by_role("button", name="Copy answer").click()
            assert page.evaluate("navigator.clipboard.readText()") == (
                "# Reversing\n\nHere is **one** way:\n\n```python\n" + source + "```\n\n"
                "That is `all`.\n"
            )
            page.get_by_role("log").get_by_role("button", name="Copy message").click()
            assert page.evaluate("navigator.clipboard.readText()") == "Show me code"
            expect(answer.locator(".meta")).to_contain_text("12 tokens")

        await run_in_browser(proxy.url, script)


# Every way an answer might try to run script, also split across chunks mid-tag.
HOSTILE = (
    "Look: <script>window.pwned = 'script'</script>\n\n"
    "<img src=x onerror=\"window.pwned = 'img'\">\n\n"
    "Inline <img src=y onerror=\"window.pwned='inline'\"> and "
    "<b onmouseover=\"window.pwned='b'\">bold</b>\n\n"
    "[a link](javascript:window.pwned='link') and ![pic](https://images.example.com/p.png)\n\n"
    "<iframe srcdoc=\"<script>parent.pwned='iframe'</script>\"></iframe>\n\n"
    "<svg onload=\"window.pwned='svg'\"><circle r=5 /></svg>\n\n"
    "<a href=\"javascript:window.pwned='a'\">raw link</a> <style>body{display:none}</style>\n"
)
DANGER = "script, img, iframe, svg, style, [onerror], [onload], [onmouseover], [href^='javascript']"


@needs_browser
async def test_answers_are_sanitised_and_never_run_script(nursery: trio.Nursery) -> None:
    """Model output is untrusted: raw HTML shows as text, and what Markdown makes goes through
    DOMPurify; no handler runs, streaming or after a reload, and no image is fetched."""
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_fake_page(nursery)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            chat = FakeChat(page)
            chat.ask("Say something nasty")
            chat.answer(HOSTILE, pieces=40)
            log = page.get_by_role("log")
            answer = page.locator("article.assistant .text").last
            expect(answer).to_contain_text("<script>window.pwned = 'script'</script>")
            expect(answer).to_contain_text("<img src=x onerror=")
            assert log.locator(DANGER).count() == 0
            link = answer.get_by_text("a link")
            link.click()
            answer.get_by_text("[image: pic]").hover()
            page.wait_for_timeout(200)
            assert page.evaluate("window.pwned") is None
            # The second layer alone: HTML straight into DOMPurify with the page's settings.
            clean = page.evaluate(
                """() => sluiceChat.sanitizeHtml(
                  '<img src=x onerror="window.pwned=1"><a href="javascript:window.pwned=2">x</a>'
                  + '<p style="color:red" class="composer" id="message" onclick="pwned=3">p</p>'
                  + '<form><input name=q></form><script>window.pwned=4</script>'
                  + '<code class="language-js">ok</code>')"""
            )
            for bad in (
                "onerror",
                "javascript:",
                "style=",
                "composer",
                "id=",
                "onclick",
                "<form",
                "<input",
                "<img",
                "<script",
            ):
                assert bad not in clean, (bad, clean)
            assert 'class="language-js"' in clean
            page.evaluate(
                "html => { const d = document.createElement('div'); d.innerHTML = html;"
                " document.body.append(d); }",
                clean,
            )
            page.wait_for_timeout(100)
            assert page.evaluate("window.pwned") is None
            # Stored, and drawn again from storage after a reload: still inert.
            page.reload()
            page.evaluate("sluiceChat.ready")
            expect(page.locator("article.assistant .text")).to_contain_text("<script>")
            page.wait_for_timeout(200)
            assert page.get_by_role("log").locator(DANGER).count() == 0
            assert page.evaluate("window.pwned") is None

        await run_in_browser(proxy.url, script)


def _bottoms(page: Page) -> dict[str, float]:
    result: dict[str, float] = page.evaluate(
        """() => {
          const box = (el) => el.getBoundingClientRect();
          const log = box(document.getElementById('conversation'));
          const last = box([...document.querySelectorAll('article.assistant')].at(-1));
          const meta = box([...document.querySelectorAll('article.assistant .meta')].at(-1));
          return {answer: last.bottom, meta: meta.bottom, logTop: log.top, logBottom: log.bottom,
                  composer: box(document.getElementById('composer')).top,
                  top: document.getElementById('conversation').scrollTop};
        }"""
    )
    return result


def _assert_latest_in_view(page: Page) -> None:
    b = _bottoms(page)
    # The whole end of the newest answer, its stats line included, is inside the log and
    # above the composer.
    assert b["logTop"] < b["meta"] <= b["answer"] <= b["logBottom"] + 1, b
    assert b["answer"] <= b["composer"], b


def _long_answer(turn: int) -> str:
    lines = [f"Line {i} of answer {turn}, long enough to take some room." for i in range(18)]
    return "\n".join(lines) + f"\n\n```\ncode of answer {turn}\n```\n"


@needs_browser
async def test_auto_scroll_follows_the_answer_unless_scrolled_up(nursery: trio.Nursery) -> None:
    """After five long turns the end of the last answer and its stats line are in view; while
    streaming too. Scrolled up on purpose, the reader stays put and gets "Jump to latest"."""
    with trio.fail_after(DEADLINE + 20):
        proxy = await serve_fake_page(nursery)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            chat = FakeChat(page)
            jump = page.get_by_role("button", name="Jump to latest")
            for turn in range(5):
                chat.ask(f"Question {turn}")
                chat.text(_long_answer(turn)[:300], pieces=3)
                page.wait_for_timeout(50)
                _assert_latest_in_view(page)
                chat.answer(_long_answer(turn)[300:], pieces=3)
                page.wait_for_timeout(50)
                _assert_latest_in_view(page)
                expect(jump).to_be_hidden()
            assert page.locator("article.assistant").count() == 5
            assert _bottoms(page)["top"] > 1000  # it really scrolled

            # A sixth answer: the reader scrolls up in the middle of it.
            chat.ask("Question 5")
            chat.text(_long_answer(5)[:200])
            page.wait_for_timeout(50)
            _assert_latest_in_view(page)
            log = page.get_by_role("log").bounding_box()
            assert log is not None
            page.mouse.move(log["x"] + log["width"] / 2, log["y"] + log["height"] / 2)
            page.mouse.wheel(0, -500)
            page.wait_for_function("document.getElementById('conversation').scrollTop > 0")
            expect(jump).to_be_visible()
            held = _bottoms(page)["top"]
            chat.text(_long_answer(5)[200:500], pieces=3)
            page.wait_for_timeout(100)
            assert _bottoms(page)["top"] == held  # not pulled down
            expect(jump).to_be_visible()
            jump.click()
            expect(jump).to_be_hidden()
            _assert_latest_in_view(page)
            chat.answer(_long_answer(5)[500:], pieces=3)  # following again
            page.wait_for_timeout(50)
            _assert_latest_in_view(page)

        await run_in_browser(proxy.url, script)


@needs_browser
async def test_conversations_survive_a_reload(nursery: trio.Nursery) -> None:
    """Chats are kept in localStorage: a reload shows the same conversation, the list has
    every chat, one can go back to an old chat and go on, and delete (two clicks)."""
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_fake_page(nursery)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            box = page.get_by_label("Message", exact=True)
            chats = page.get_by_role("navigation", name="Chats").get_by_role("listitem")

            def ask(text: str) -> None:
                box.fill(text)
                box.press("Enter")
                expect(page.get_by_role("status")).to_contain_text("Done")

            ask("First question")
            expect(page.locator("article.assistant .text")).to_have_text("The quick brown")
            page.get_by_role("button", name="New chat").click()
            assert page.locator("article").count() == 0
            expect(chats).to_have_count(1)
            ask("Second question")
            expect(chats).to_have_count(2)
            expect(chats.first.get_by_role("button").first).to_have_text("Second question")
            expect(chats.first.get_by_role("button").first).to_have_attribute(
                "aria-current", "true"
            )
            meta = page.locator("article.assistant .meta").text_content()

            page.reload()
            page.evaluate("sluiceChat.ready")
            expect(page.locator("article")).to_have_count(2)
            expect(page.locator("article.user .text")).to_have_text("Second question")
            expect(page.locator("article.assistant .text")).to_have_text("The quick brown")
            expect(page.locator("article.assistant .meta")).to_have_text(meta or "")
            expect(chats).to_have_count(2)

            # Back to the first chat, and on with it: the request carries its history.
            page.get_by_role("button", name="First question", exact=True).click()
            expect(page.locator("article.user .text")).to_have_text("First question")
            with page.expect_request(lambda r: r.url.endswith(CHAT)) as sent:
                ask("Follow-up")
            messages = json.loads(sent.value.post_data or "")["messages"]
            assert [m["content"] for m in messages] == [
                "First question",
                "The quick brown ",
                "Follow-up",
            ]
            page.reload()
            page.evaluate("sluiceChat.ready")
            expect(page.locator("article")).to_have_count(4)

            # Delete: the first click asks, the second deletes.
            delete = page.get_by_role("button", name="Delete chat: Second question")
            delete.click()
            page.get_by_role("button", name="Really delete chat: Second question").click()
            expect(chats).to_have_count(1)
            page.get_by_role("button", name="Delete chat: First question").click()
            page.get_by_role("button", name="Really delete chat: First question").click()
            expect(chats).to_have_count(0)
            assert page.locator("article").count() == 0
            stored = page.evaluate(
                "Object.keys(localStorage).filter(k => k.startsWith('sluice.chat.'))"
            )
            assert stored == []
            page.reload()
            page.evaluate("sluiceChat.ready")
            assert page.locator("article").count() == 0

            # A reload in the middle of an answer keeps what had arrived.
            chat = FakeChat(page)
            chat.ask("Cut short")
            chat.text("Half of it")
            expect(page.locator("article.assistant .text")).to_have_text("Half of it")
            page.reload()
            page.evaluate("sluiceChat.ready")
            expect(page.locator("article.assistant .text")).to_have_text("Half of it")
            expect(page.locator("article.assistant .meta")).to_contain_text("Stopped by a reload")

        await run_in_browser(proxy.url, script)


@needs_browser
async def test_system_prompt_parameters_regenerate_edit_and_length(
    nursery: trio.Nursery,
) -> None:
    """The system prompt, temperature and top_p go with every request; Regenerate asks for the
    last answer again; Edit drops what followed and sends the edited message; an answer cut at
    max tokens is marked, also after a reload, which keeps the settings."""
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_fake_page(nursery)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            chat = FakeChat(page)
            page.get_by_label("System prompt").fill("Answer in one word.")
            page.get_by_label("Temperature").fill("0.3")
            page.get_by_label("Top p").fill("0.9")
            page.get_by_label("Max tokens").fill("50")
            system = {"role": "system", "content": "Answer in one word."}
            question = {"role": "user", "content": "Capital of France?"}
            body = chat.ask("Capital of France?")
            assert body["messages"] == [system, question]
            assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.3, 0.9, 50)
            chat.answer("Paris.")
            regenerate = page.get_by_role("button", name="Regenerate")
            expect(regenerate).to_have_count(1)

            regenerate.click()
            page.wait_for_function("fakeChat.requests.length === 2")
            assert page.evaluate("fakeChat.requests[1].messages") == [system, question]
            chat.answer("Paris!")
            expect(page.locator("article.assistant .text")).to_have_text("Paris!")

            chat.ask("And Spain?")
            chat.answer("Madrid.")
            expect(page.locator("article")).to_have_count(4)
            expect(regenerate).to_have_count(1)  # on the last answer only
            assert page.locator("article").last.get_by_role("button", name="Regenerate").count()

            # Edit, then cancel: nothing changes.
            first = page.locator("article.user").first
            first.get_by_role("button", name="Edit message").click()
            edited = page.get_by_label("Edited message")
            edited.fill("Something else")
            first.get_by_role("button", name="Cancel").click()
            expect(first.locator(".text")).to_have_text("Capital of France?")
            # Edit and send: the later turns go, the edited message is asked.
            first.get_by_role("button", name="Edit message").click()
            edited.fill("Capital of Italy?")
            page.get_by_role("button", name="Save and send").click()
            page.wait_for_function("fakeChat.requests.length === 4")
            assert page.evaluate("fakeChat.requests[3].messages") == [
                system,
                {"role": "user", "content": "Capital of Italy?"},
            ]
            chat.answer("Rome.")
            expect(page.locator("article")).to_have_count(2)
            expect(page.locator("article.user .text")).to_have_text("Capital of Italy?")

            # Cut off at max tokens: marked, in words.
            chat.ask("Tell me everything about Rome.")
            chat.text("Rome was founded")
            chat.done("length", completion_tokens=50)
            last = page.locator("article.assistant").last
            expect(last).to_have_class(re.compile(r"\blength\b"))
            expect(last.locator(".meta")).to_contain_text("Cut off at the max tokens limit")
            expect(page.get_by_role("status")).to_contain_text("cut off at max tokens")
            assert page.locator("article.assistant.length").count() == 1

            page.reload()
            page.evaluate("sluiceChat.ready")
            expect(page.get_by_label("System prompt")).to_have_value("Answer in one word.")
            expect(page.get_by_label("Temperature")).to_have_value("0.3")
            expect(page.get_by_label("Top p")).to_have_value("0.9")
            expect(page.locator("article")).to_have_count(4)
            expect(page.locator("article.assistant.length .meta")).to_contain_text("Cut off")

        await run_in_browser(proxy.url, script)


PHONE: ViewportSize = {"width": 375, "height": 740}


@needs_browser
async def test_phone_layout(nursery: trio.Nursery, tmp_path: Path) -> None:
    """At 375 px: settings folded behind a button, chats in a drawer, Send beside the box,
    nothing wider than the screen, and the answer's end above the composer."""
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_fake_page(nursery)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            settings = page.get_by_role("button", name="Settings")
            expect(settings).to_have_attribute("aria-expanded", "false")
            expect(page.get_by_label("Model", exact=True)).to_be_hidden()
            expect(page.get_by_label("Max tokens")).to_be_hidden()
            expect(page.get_by_role("button", name="New chat")).to_be_hidden()
            box = page.get_by_label("Message", exact=True)
            send = page.get_by_role("button", name="Send")
            b, s = box.bounding_box(), send.bounding_box()
            assert b is not None and s is not None
            assert s["x"] >= b["x"] + b["width"] - 1, (b, s)  # beside, to the right
            assert s["y"] < b["y"] + b["height"] and s["y"] + s["height"] > b["y"], (b, s)
            assert s["x"] + s["width"] <= 375
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 375, width

            settings.click()
            expect(settings).to_have_attribute("aria-expanded", "true")
            expect(page.get_by_label("Model", exact=True)).to_be_visible()
            expect(page.get_by_label("Model", exact=True)).to_have_value("fake-model")
            assert page.evaluate("document.documentElement.scrollWidth") <= 375
            settings.click()
            expect(page.get_by_label("Model", exact=True)).to_be_hidden()

            for question in ("Hello there", "And again, a longer question this time?"):
                box.fill(question)
                send.click()
                expect(page.get_by_role("status")).to_contain_text("Done")
            _assert_latest_in_view(page)
            assert page.evaluate("document.documentElement.scrollWidth") <= 375

            page.get_by_role("button", name="Chats").click()
            new_chat = page.get_by_role("button", name="New chat")
            expect(new_chat).to_be_visible()
            expect(page.get_by_role("button", name="Hello there", exact=True)).to_be_visible()
            page.keyboard.press("Escape")
            expect(new_chat).to_be_hidden()
            page.screenshot(path=tmp_path / "phone.png")

        await run_in_browser(proxy.url, script, viewport=PHONE)
        assert (tmp_path / "phone.png").stat().st_size > 5_000


def _background(page: Page) -> str:
    value: str = page.evaluate("getComputedStyle(document.body).backgroundColor")
    return value


@needs_browser
async def test_dark_mode_follows_the_system_and_toggles(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE + 10):
        proxy = await serve_fake_page(nursery)
        dark_bg, light_bg = "rgb(20, 23, 28)", "rgb(246, 247, 249)"

        def on_dark_system(page: Page) -> None:
            from playwright.sync_api import expect

            toggle = page.get_by_role("button", name="Dark mode")
            expect(toggle).to_have_attribute("aria-pressed", "true")  # the system's setting
            assert _background(page) == dark_bg
            toggle.click()
            expect(toggle).to_have_attribute("aria-pressed", "false")
            assert _background(page) == light_bg
            assert page.evaluate("localStorage.getItem('sluice.theme')") == "light"
            page.reload()
            expect(page.get_by_role("button", name="Dark mode")).to_have_attribute(
                "aria-pressed", "false"
            )
            assert _background(page) == light_bg
            page.get_by_role("button", name="Dark mode").click()  # back to the system's
            assert _background(page) == dark_bg
            assert page.evaluate("localStorage.getItem('sluice.theme')") is None
            page.emulate_media(color_scheme="light")  # the system changes: the page follows
            expect(page.get_by_role("button", name="Dark mode")).to_have_attribute(
                "aria-pressed", "false"
            )
            assert _background(page) == light_bg

        def on_light_system(page: Page) -> None:
            from playwright.sync_api import expect

            toggle = page.get_by_role("button", name="Dark mode")
            expect(toggle).to_have_attribute("aria-pressed", "false")
            toggle.click()
            expect(toggle).to_have_attribute("aria-pressed", "true")
            assert _background(page) == dark_bg
            page.emulate_media(color_scheme="light")
            assert _background(page) == dark_bg  # chosen by hand: stays

        await run_in_browser(proxy.url, on_dark_system, color_scheme="dark")
        await run_in_browser(proxy.url, on_light_system)


@needs_browser
async def test_a_loading_model_is_announced_and_send_waits(nursery: trio.Nursery) -> None:
    """While /healthz says a model loads, the page says "Loading <model>…", keeps Send off and
    asks again about every second; once it says ok, Send is on. A 503 model_loading from the
    chat endpoint says so in words and starts the polling again."""
    with trio.fail_after(DEADLINE + 20):
        proxy = await serve_fake_page(nursery)
        health: dict[str, Any] = {"body": {"status": "loading", "loading": ["fake-model"]}}
        asked: list[float] = []

        def setup(page: Page) -> None:
            def answer(route: Route) -> None:
                asked.append(time.monotonic())
                route.fulfill(status=200, json=health["body"])

            page.route("**/healthz", answer)

        def script(page: Page) -> None:
            from playwright.sync_api import expect

            status = page.get_by_role("status")
            send = page.get_by_role("button", name="Send")
            expect(status).to_have_text("Loading fake-model…")
            expect(send).to_be_disabled()
            expect(page.locator("#model option")).to_have_text("fake-model (loading…)")
            box = page.get_by_label("Message", exact=True)
            box.fill("Hi")
            box.press("Enter")
            assert page.locator("article").count() == 0  # not sent
            expect(box).to_have_value("Hi")
            # The server's own shape: a mapping of model to stage. Each change shows at the next
            # poll, about a second on: the default wait (10 s) leaves a loaded machine room.
            health["body"] = {"status": "loading", "loading": {"fake-model": "reading weights"}}
            expect(status).to_have_text("Loading fake-model (reading weights)…")
            expect(send).to_be_disabled()
            health["body"] = {"status": "ok", "loading": {}}
            expect(send).to_be_enabled()
            expect(status).to_have_text("fake-model is ready.")
            expect(page.locator("#model option")).to_have_text("fake-model")
            polls = len(asked)
            gaps = [b - a for a, b in itertools.pairwise(asked)]
            assert polls >= 3 and min(gaps) > 0.7, gaps
            page.wait_for_timeout(1500)
            assert len(asked) == polls  # ready: no more polling

            # A 503 model_loading from the API itself (the model went away and is back to
            # loading): told in words, the draft kept, and /healthz watched again.
            health["body"] = {"status": "loading", "loading": ["fake-model"]}
            error = {
                "error": {
                    "message": "model 'fake-model' is loading",
                    "type": "x",
                    "code": "model_loading",
                }
            }
            page.route(
                "**" + CHAT,
                lambda route: route.fulfill(status=503, json=error, headers={"Retry-After": "2"}),
            )
            box.press("Enter")
            expect(page.get_by_role("alert")).to_have_text(
                "fake-model is still loading, try again in 2 s."
            )
            expect(box).to_have_value("Hi")
            expect(status).to_have_text("Loading fake-model…")
            expect(send).to_be_disabled()
            page.unroute("**" + CHAT)
            health["body"] = {"status": "ok", "loading": {}}
            expect(send).to_be_enabled()
            send.click()
            expect(status).to_contain_text("Done")

        await run_in_browser(proxy.url, script, setup=setup)


# -- docs/chat-page.png ------------------------------------------------------------------------


def make_screenshot(target: str, phone_target: str | None = None) -> None:
    """Serve ``conf/local.toml`` (the real SmolLM2; loading takes a while) with the page, have a
    short conversation and save a screenshot while the second answer (a code block) streams;
    then, with ``phone_target``, the same conversation after a reload at phone width (375 px:
    settings folded, the conversation kept). Sampling is not seeded, so the first question is
    asked again until its answer is short and right, and the second until it has code.

        .venv/bin/python -m tests.api.test_chat_page docs/chat-page.png docs/chat-page-mobile.png
    """
    from proxy.config import load_config

    def browse(url: str) -> None:
        from playwright.sync_api import expect, sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport=VIEWPORT).new_page()
            page.goto(url + "/")
            # The port answers while the model loads: "Loading smollm2…", Send waits.
            expect(page.get_by_role("button", name="Send")).to_be_enabled(timeout=300_000)
            expect(page.get_by_label("Model", exact=True)).to_have_value("smollm2")
            max_tokens = page.get_by_label("Max tokens")
            box = page.get_by_label("Message", exact=True)
            status = page.get_by_role("status")
            for _ in range(8):
                max_tokens.fill("80")
                box.fill("What is the capital of France?")
                box.press("Enter")
                expect(status).to_contain_text("Done", timeout=60_000)
                answer = page.locator("article.assistant .text").last.text_content() or ""
                if "Paris" in answer and len(answer) < 120:
                    break
                # Not that one: delete the chat (two clicks) and ask in a fresh one.
                delete = page.locator(".chat-item:has([aria-current]) .chat-delete")
                delete.click()
                delete.click()
                expect(page.locator("article")).to_have_count(0)
            max_tokens.fill("200")
            code = page.locator("article.assistant.streaming pre code")
            box.fill("Write a Python function that reverses a string.")
            box.press("Enter")
            for _ in range(6):
                try:
                    expect(code).to_contain_text("return", timeout=30_000)
                    break
                except AssertionError:  # no code this time: stop it and ask again
                    page.keyboard.press("Escape")
                    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
                    page.get_by_role("button", name="Regenerate").click()
            page.wait_for_timeout(2500)  # into the explanation after the code
            page.screenshot(path=target)
            expect(status).to_contain_text("Done", timeout=60_000)
            if phone_target:
                page.set_viewport_size(PHONE)
                page.reload()
                expect(page.get_by_label("Message", exact=True)).to_be_visible()
                page.evaluate("sluiceChat.ready")
                page.wait_for_timeout(300)
                page.screenshot(path=phone_target)
            browser.close()

    async def main() -> None:
        config = load_config(Path(__file__).parents[2] / "conf" / "local.toml", env={}, port=0)
        app = create_app(config, env={})
        if web.blueprint.name not in app.blueprints:
            app.register_blueprint(web.blueprint)
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, app, config)
            await trio.to_thread.run_sync(browse, binds[0])
            nursery.cancel_scope.cancel()

    trio.run(main)


if __name__ == "__main__":
    import sys

    make_screenshot(
        sys.argv[1] if len(sys.argv) > 1 else "docs/chat-page.png",
        sys.argv[2] if len(sys.argv) > 2 else "docs/chat-page-mobile.png",
    )
