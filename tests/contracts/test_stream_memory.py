"""Bounded memory per stream, at the lengths users live with: a real ``sluice serve`` process,
its RSS read from /proc, while 20 clients each read a 10,000-token answer at once.

With the default settings (preemption off) nothing of an answer is kept: the RSS after the
streams is within 10 MB of the RSS before them. With preemption on, a pausable stream keeps its
answer's text and at most ``PENDING_BYTES`` of events (proxy/protocol/continuation.py): measured
here and held within the same 10 MB (20 answers of 10,000 tokens are ~1 MB of text)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.support import chat_body, rss_mb, sse_payloads, start_fake, start_sluice, stop

STREAMS = 20
TOKENS = 10_000
CHAT = "/v1/chat/completions"


async def read_answers(url: str, count: int) -> None:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:

        async def one() -> None:
            text = ""
            async with client.stream("POST", url + CHAT, json=chat_body()) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_text():
                    text += chunk
            payloads = sse_payloads(text)
            assert payloads[-1] == "[DONE]"
            assert len(payloads) > TOKENS

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)


@pytest.mark.parametrize("preempt_after", [0.0, 0.5], ids=["preemption off", "preemption on"])
async def test_twenty_ten_thousand_token_streams_leave_the_rss_flat(
    nursery: trio.Nursery, tmp_path: Path, preempt_after: float
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=TOKENS)
    config = tmp_path / "memory.toml"
    config.write_text(
        "[server]\nport = 0\n"
        f"[scheduling]\npreempt_after = {preempt_after}\n"
        f'[models.fake-model]\nupstreams = ["{fake.url}"]\n'
    )
    with trio.fail_after(240):
        process, url = await start_sluice(config)
        try:
            # One stream first: what any first request allocates (pools, caches) is not the
            # streams' growth.
            await read_answers(url, 1)
            await trio.sleep(0.2)
            before = rss_mb(process.pid)
            await read_answers(url, STREAMS)
            await trio.sleep(0.2)
            after = rss_mb(process.pid)
            print(f"RSS {before:.1f} -> {after:.1f} MB (preempt_after={preempt_after})")
            assert after - before <= 10.0, (before, after)
        finally:
            await stop(process)
