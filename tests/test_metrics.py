"""GET /metrics: Prometheus text that parses, and counters that move with the traffic."""

from __future__ import annotations

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support import DEADLINE, Fake, Proxy, RawClient, chat_body, start_proxy

CHAT = "/v1/chat/completions"


async def scrape(
    client: httpx.AsyncClient, proxy: Proxy
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = await client.get(proxy.url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_request_counters_move(proxy: Proxy, fake: Fake, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        before = await scrape(client, proxy)
        assert value(before, "sluice_requests_total", model="fake-model", status="200") == 0
        assert (await client.post(proxy.url + CHAT, json=chat_body())).status_code == 200
        assert (await client.post(proxy.url + CHAT, content=b"{")).status_code == 400
        assert (await client.post(proxy.url + CHAT, json=chat_body("made-up"))).status_code == 404
        after = await scrape(client, proxy)
        assert value(after, "sluice_requests_total", model="fake-model", status="200") == 1
        assert value(after, "sluice_requests_total", model="-", status="400") == 1
        # An unknown model is counted without its name: clients cannot grow the label set.
        assert value(after, "sluice_requests_total", model="-", status="404") == 1
        assert value(after, "sluice_active_streams") == 0


async def test_cancellations_are_measured_by_phase(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        # One client leaves while the upstream thinks, one in the middle of the stream.
        waiting = await RawClient.post(proxy, CHAT, chat_body(fake={"ttft": 30}))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        await waiting.close()
        await proxy.state.tracker.wait_idle()
        streaming = await RawClient.post(
            proxy, CHAT, chat_body(fake={"ttft": 0, "interval": 0.01, "tokens": 1000})
        )
        await streaming.read_until(b"data: ", count=3)
        await streaming.close()
        await proxy.state.tracker.wait_idle()
        samples = await scrape(client, proxy)
        for phase in ("awaiting_first_token", "streaming"):
            assert (
                value(samples, "sluice_cancellations_total", backend="upstream", phase=phase) == 1
            ), phase
        count = value(samples, "sluice_cancel_propagation_seconds_count", backend="upstream")
        total = value(samples, "sluice_cancel_propagation_seconds_sum", backend="upstream")
        assert count == 2
        assert 0 < total < 2 * 0.05
        assert value(samples, "sluice_wasted_tokens_count", backend="upstream") == 2
        # Nothing was produced for the first client, so nothing was wasted there.
        assert value(samples, "sluice_wasted_tokens_bucket", backend="upstream", le="0.0") >= 1
        assert value(samples, "sluice_requests_total", model="fake-model", status="499") == 1
