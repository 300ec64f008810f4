"""The chat page (``proxy/web.py``, ``proxy/static/``) in a real headless Chromium.

The proxy runs in the test's trio nursery (real hypercorn on 127.0.0.1:0); the browser is driven
by Playwright's sync API in a worker thread (``trio.to_thread.run_sync``: Playwright runs its own
asyncio loop there), which calls back into trio (``trio.from_thread``) to look at the server
while the page streams. Playwright's own timeouts bound every browser step, so the thread always
returns; the trio side runs under ``fail_after`` as usual.

Needs Playwright (the ``dev`` extra) and a Chromium at ``/usr/bin/chromium`` (or
``$SLUICE_CHROMIUM``); Playwright's own browser downloads are never used. Without either, the
browser tests skip and say why.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

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
    from playwright.sync_api import Page, Request, Route, ViewportSize

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


def in_browser(url: str, script: Callable[[Page], T]) -> T:
    """Open ``url`` in a fresh headless Chromium and run ``script(page)``; runs in a thread.
    Fails on any script error in the page and on any request that leaves ``url``'s origin."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=BROWSER_TIMEOUT_MS)
    page_errors: list[str] = []
    foreign: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=VIEWPORT)
            context.set_default_timeout(BROWSER_TIMEOUT_MS)
            page = context.new_page()
            page.on("pageerror", lambda error: page_errors.append(str(error)))

            def check_origin(request: Request) -> None:
                if not request.url.startswith((url, "data:")):
                    foreign.append(request.url)

            page.on("request", check_origin)
            page.goto(url + "/")
            page.wait_for_function("window.sluiceChat && window.sluiceChat.ready !== null")
            page.evaluate("window.sluiceChat.ready")  # waits for the model list
            result = script(page)
        finally:
            browser.close()
    assert page_errors == []
    assert foreign == []
    return result


async def run_in_browser(url: str, script: Callable[[Page], T]) -> T:
    return await trio.to_thread.run_sync(partial(in_browser, url, script))


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
            assert on_trio(lambda: backend.active_threads) == 1

            report["steps_at_stop"] = on_trio(lambda: loaded.model.steps)
            clicked = time.monotonic()
            page.get_by_role("button", name="Stop").click()
            trio.from_thread.run(backend.admission.wait_free)
            report["click_to_free"] = time.monotonic() - clicked
            report["steps_after"] = on_trio(lambda: loaded.model.steps)
            expect(page.get_by_role("status")).to_contain_text("Stopped")
            expect(page.locator("article.assistant .meta").last).to_contain_text("Stopped")
            expect(page.get_by_role("button", name="Stop")).to_be_disabled()
            stopped_text = answer.text_content() or ""
            assert len(stopped_text) >= lengths[-1]

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
            expect(page.get_by_role("alert")).to_be_hidden()
            assert page.locator("#conversation").get_attribute("aria-busy") == "false"
            report["screenshot"] = tmp_path / "chat-page.png"
            page.screenshot(path=report["screenshot"])

        await run_in_browser(proxy.url, script)

        # The server saw the page leave: the relay was cancelled mid-stream, and the model
        # stopped within about one decode step of the disconnect.
        await backend.admission.wait_free()
        assert backend.active_threads == 0
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.cancelled == 1
        registry = proxy.state.metrics.registry
        labels = {"backend": "local", "phase": "streaming"}
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
        holder = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=10_000))
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
            "sluice_requests_total", {"model": "tiny", "status": "429", "endpoint": "chat"}
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

            # A burst: 300 tokens in one read are drawn in a frame or two, not 300 times.
            tokens = [f"t{i} " for i in range(300)]
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 300}}
            ask(fulfill(200, _sse(*map(_chunk, tokens), usage, "[DONE]")))
            expect(page.get_by_role("status")).to_contain_text("Done")
            expect(alert).to_be_hidden()
            expect(page.locator("article.assistant .text").last).to_have_text("".join(tokens))
            turn = page.evaluate(
                "({r: sluiceChat.lastTurn.renders, c: sluiceChat.lastTurn.chunks})"
            )
            assert turn["c"] == 300 and turn["r"] <= 3, turn
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


# -- docs/chat-page.png ------------------------------------------------------------------------


def make_screenshot(target: str) -> None:
    """Serve ``conf/local.toml`` (the real SmolLM2; loading takes a while) with the page, have a
    short conversation and save a screenshot in the middle of the second answer. Sampling is not
    seeded, so the first question is asked again until its answer is short and right.

        .venv/bin/python -m tests.test_chat_page docs/chat-page.png
    """
    from proxy.config import load_config

    def browse(url: str) -> None:
        from playwright.sync_api import expect, sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport=VIEWPORT).new_page()
            page.goto(url + "/")
            expect(page.get_by_label("Model", exact=True)).to_have_value("smollm2")
            page.get_by_label("Max tokens").fill("80")
            box = page.get_by_label("Message", exact=True)
            for _ in range(8):
                box.fill("What is the capital of France?")
                box.press("Enter")
                expect(page.get_by_role("status")).to_contain_text("Done", timeout=60_000)
                answer = page.locator("article.assistant .text").last.text_content() or ""
                if "Paris" in answer and len(answer) < 120:
                    break
                page.get_by_role("button", name="New chat").click()
            box.fill("Write a short poem about a river.")
            box.press("Enter")
            page.wait_for_timeout(2500)
            page.screenshot(path=target)
            page.keyboard.press("Escape")
            browser.close()

    async def main() -> None:
        config = load_config(Path(__file__).parents[1] / "conf" / "local.toml", env={}, port=0)
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

    make_screenshot(sys.argv[1] if len(sys.argv) > 1 else "docs/chat-page.png")
