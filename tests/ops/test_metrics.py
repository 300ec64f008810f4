"""GET /metrics: Prometheus text that parses, and counters that move with the traffic."""

from __future__ import annotations

import re
import socket
from bisect import bisect_left
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.token_budget import waste_cause
from proxy.ops.metrics import BucketHistogram, Metrics, MetricSpec
from tests.support import (
    DEADLINE,
    LOCKSTEP_WORDS,
    Fake,
    Proxy,
    RawClient,
    cancel_while_waiting_then_mid_stream,
    chat_body,
    mark_read,
    serve_in_lockstep,
    slowed,
    sse_payloads,
    start_fake,
    start_proxy,
    stream_text,
)

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


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (the others, such as
    the endpoint, summed over)."""
    wanted = set(labels.items())
    return sum(
        sample
        for (sample_name, sample_labels), sample in samples.items()
        if sample_name == name and wanted <= sample_labels
    )


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


# How long each leaving client stays first: longer than the proxy takes to let it go.
STAY = 0.3


async def test_cancellations_are_measured_by_phase(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    """Each propagation is measured from the client's leaving to its work gone: it lies within
    the window from the close to the proxy's being idle again, however slowly this machine
    runs (how soon the upstream is closed, the timing tests prove)."""
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        # One client leaves while the upstream thinks, one in the middle of the stream.
        # Each client stays a while first: a propagation measured from the request's start,
        # not from its client's leaving, would count that time too.
        windows = await cancel_while_waiting_then_mid_stream(proxy, fake, stay=STAY)
        samples = await scrape(client, proxy)
        for phase in ("first_token", "mid_stream"):
            assert (
                value(samples, "sluice_cancellations_total", backend="upstream", phase=phase) == 1
            ), phase
        count = value(samples, "sluice_cancel_propagation_seconds_count", backend="upstream")
        total = value(samples, "sluice_cancel_propagation_seconds_sum", backend="upstream")
        assert count == 2
        # From each leaving, not from the request's start (STAY before it), and in seconds.
        assert 0 < total <= windows, (total, windows)
        assert value(samples, "sluice_wasted_tokens_count", backend="upstream") == 2
        # Nothing was produced for the first client, so nothing was wasted there.
        assert value(samples, "sluice_wasted_tokens_bucket", backend="upstream", le="0.0") >= 1
        assert value(samples, "sluice_requests_total", model="fake-model", status="499") == 1


def bucket_counts(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> dict[tuple[float, float], float]:
    """A histogram's observations per bucket, keyed by the bucket's (lower, upper] bounds."""
    cumulative: dict[float, float] = {}
    for (sample_name, sample_labels), sample in samples.items():
        if sample_name == f"{name}_bucket" and set(labels.items()) <= sample_labels:
            upper = float(dict(sample_labels)["le"])
            cumulative[upper] = cumulative.get(upper, 0.0) + sample
    counts = {}
    lower, below = 0.0, 0.0
    for upper, at_most in sorted(cumulative.items()):
        if at_most > below:
            counts[(lower, upper)] = at_most - below
        lower, below = upper, at_most
    return counts


def data_events(text: str) -> int:
    """SSE data events in a response body, [DONE] excluded: what sluice_tokens_out counts."""
    return sum(1 for payload in sse_payloads(text) if payload != "[DONE]")


# How long the paced stream's client waits after each event before the upstream may send on.
READ_PAUSE = 0.1


async def test_stream_metrics_move(nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.05, interval=0.03, tokens=8)
        read = [trio.Event() for _ in LOCKSTEP_WORDS]
        lockstep = await nursery.start(serve_in_lockstep, read)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url], "lockstep": [f"http://127.0.0.1:{lockstep}"]}
        )
        before = await scrape(client, proxy)
        assert value(before, "sluice_ttft_seconds_count", model="fake-model") == 0
        streamed = 0
        for _ in range(2):
            response = await client.post(proxy.url + CHAT, json=chat_body())
            assert response.status_code == 200
            streamed += data_events(response.text)
        # A stream whose upstream sends each word only once the client has read the one before
        # and waited READ_PAUSE: each of those words is a write of its own, at least READ_PAUSE
        # after the one before.
        started = trio.current_time()
        payloads: list[str] = []
        async with client.stream("POST", proxy.url + CHAT, json=chat_body("lockstep")) as paced:
            async for line in paced.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    await trio.sleep(READ_PAUSE)
                    mark_read(read, stream_text(payloads))
        lasted = trio.current_time() - started
        assert stream_text(payloads) == "".join(LOCKSTEP_WORDS)
        # A response that is not streamed has no first token and no gaps.
        whole = await client.post(proxy.url + CHAT, json=chat_body(stream=False))
        assert whole.status_code == 200
        await proxy.state.tracker.wait_idle()
        after = await scrape(client, proxy)
        assert value(after, "sluice_ttft_seconds_count", model="fake-model") == 2
        ttft_sum = value(after, "sluice_ttft_seconds_sum", model="fake-model")
        assert 2 * 0.05 <= ttft_sum < 2 * 2.0
        assert streamed >= 2 * 8
        assert value(after, "sluice_tokens_out_total", model="fake-model") == streamed
        # A write may carry several events (a loaded machine coalesces a burst), so there are
        # at most events - 1 gaps, and each is counted in the bucket of its length.
        gaps = value(after, "sluice_token_gap_seconds_count", model="fake-model")
        assert gaps <= streamed
        assert (
            value(after, "sluice_token_gap_seconds_bucket", model="fake-model", le="+Inf") == gaps
        )
        gap_sum = value(after, "sluice_token_gap_seconds_sum", model="fake-model")
        assert gap_sum < 2 * 3.0
        counts = bucket_counts(after, "sluice_token_gap_seconds", model="fake-model")
        assert sum(counts.values()) == gaps
        lowest = sum(count * lower for (lower, _), count in counts.items())
        highest = sum(count * upper for (_, upper), count in counts.items())
        assert lowest <= gap_sum * (1 + 1e-9) and gap_sum <= highest * (1 + 1e-9), counts
        # The gaps are the time between writes: the first token's write (the TTFT after the
        # relay's start, which is before the upstream had the request) and the gaps after it
        # reach the last token, which the fake sends no sooner than ttft + 7 intervals after
        # it had the request. A lower bound only: a slow machine only makes the writes later.
        assert ttft_sum + gap_sum >= 2 * (0.05 + 7 * 0.03) * (1 - 1e-9)
        # Each gap is between two writes (not since the first token, nor one per stream): the
        # paced stream has a gap over 50 ms per word after its first, and its gaps add up to no
        # more than its whole time.
        paced_gaps = value(after, "sluice_token_gap_seconds_count", model="lockstep")
        short = value(after, "sluice_token_gap_seconds_bucket", model="lockstep", le="0.05")
        assert paced_gaps - short >= len(LOCKSTEP_WORDS) - 1, (paced_gaps, short)
        paced_sum = value(after, "sluice_token_gap_seconds_sum", model="lockstep")
        assert paced_sum <= lasted, (paced_sum, lasted)


async def test_upstream_errors_count_retried_attempts(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        refusing = f"http://127.0.0.1:{closed_port()}"
        # Listed first: with both idle, the first replica is tried first.
        proxy = await start_proxy(nursery, {"fake-model": [refusing, fake.url]})
        response = await client.post(proxy.url + CHAT, json=chat_body())
        assert response.status_code == 200  # retried on the healthy replica
        assert len(fake.recorder.records) == 1
        samples = await scrape(client, proxy)
        assert (
            value(
                samples,
                "sluice_upstream_errors_total",
                model="fake-model",
                code="upstream_connect_error",
            )
            == 1
        )
        assert value(samples, "sluice_requests_total", model="fake-model", status="200") == 1
        # A model whose only replica refuses: its one failure is counted too.
        proxy = await start_proxy(nursery, {"m": [refusing]})
        response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 502
        samples = await scrape(client, proxy)
        assert (
            value(samples, "sluice_upstream_errors_total", model="m", code="upstream_connect_error")
            == 1
        )


async def test_local_queue_and_step_metrics(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.02)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {
                "tiny": {
                    "backend": "local",
                    "path": "unused-preloaded",
                    "slots": 1,
                    "max_queue": 1,
                    "queue_timeout": 30,
                }
            },
            local_models={"tiny": loaded},
        )
        backend = proxy.state.local_backends["tiny"]
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_queue_depth", model="tiny") == 0
        running = await RawClient.post(proxy, CHAT, chat_body("tiny"))
        # Its first token, not only the role delta (whose content is ""): its TTFT is then
        # measured however slowly this machine runs the rest.
        await running.read_until(b'"content":"', count=2)
        queued = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=4))
        await backend.admission.wait_queued(1)
        refused = await client.post(proxy.url + CHAT, json=chat_body("tiny", max_tokens=2))
        assert refused.status_code == 429
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_queue_depth", model="tiny") == 1
        assert (
            value(samples, "sluice_queue_wait_seconds_count", model="tiny", outcome="admitted") == 1
        )
        assert (
            value(samples, "sluice_queue_wait_seconds_count", model="tiny", outcome="queue_full")
            == 1
        )
        await trio.sleep(0.05)  # the queued one has waited at least this long
        await running.close()  # its slot goes to the queued request
        await queued.read_until(b"data: [DONE]")
        await queued.close()
        await proxy.state.tracker.wait_idle()
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_queue_depth", model="tiny") == 0
        assert (
            value(samples, "sluice_queue_wait_seconds_count", model="tiny", outcome="admitted") == 2
        )
        waited = value(samples, "sluice_queue_wait_seconds_sum", model="tiny", outcome="admitted")
        assert 0.05 <= waited < DEADLINE
        # Every model call is in the metrics as it happens, the cancelled request's too: two
        # prefills, and each decode step once, by batch size (one at a time here), >= 20 ms.
        model = loaded.model
        assert value(samples, "sluice_local_prefill_seconds_count", model="tiny") == 2
        assert model.prefills == 2
        steps = value(samples, "sluice_local_step_seconds_count", model="tiny", batch_size="1")
        assert steps == model.steps - model.prefills >= 3
        assert (
            value(
                samples, "sluice_local_step_seconds_bucket", model="tiny", batch_size="1", le="0.01"
            )
            == 0
        )
        assert (
            value(samples, "sluice_local_step_seconds_sum", model="tiny", batch_size="1")
            >= steps * 0.02
        )
        # One token per prefill and per sequence in each step.
        assert value(samples, "sluice_local_generated_tokens_total", model="tiny") == steps + 2
        assert value(samples, "sluice_local_batch_size", model="tiny") == 0
        # The running request's client left: its sequence stopped within the step in flight,
        # and what that step made (if anything) is counted as made for nobody.
        assert value(samples, "sluice_local_steps_after_cancel_count", model="tiny") == 1
        after_cancel = value(samples, "sluice_local_steps_after_cancel_sum", model="tiny")
        assert after_cancel <= 1
        assert value(samples, "sluice_local_tokens_for_nobody_total", model="tiny") == after_cancel
        # The local streams are in the stream metrics too.
        assert value(samples, "sluice_ttft_seconds_count", model="tiny") == 2
        assert value(samples, "sluice_tokens_out_total", model="tiny") >= 4


def test_every_declared_metric_is_built_under_its_attribute() -> None:
    metrics = Metrics()
    specs = {name: spec for name, spec in vars(Metrics).items() if isinstance(spec, MetricSpec)}
    text = metrics.render()[0].decode()
    # 21, the key's tokens, the local prefix cache's 4, the scheduler's 3, preemption's 2,
    # auth's 2, cache_aware's 6, guards' 2, the learned upstream capacity
    assert len(specs) == 42
    for attribute, spec in specs.items():
        assert isinstance(getattr(metrics, attribute), spec.kind)
        help_line = rf"^# HELP {spec.name}(_total)? {re.escape(spec.documentation)}$"
        assert re.search(help_line, text, re.MULTILINE), spec.name
    # One registry per app: a second Metrics registers the same names without a clash.
    assert Metrics().requests is not metrics.requests


def test_bucket_histogram_merges_counts() -> None:
    registry = CollectorRegistry()
    histogram = BucketHistogram("demo_seconds", "A demo.", ["model"], (0.1, 1.0), registry)
    counts = histogram.new_counts()
    for seconds in (0.05, 0.1, 0.5, 3.0):
        counts[bisect_left(histogram.bounds, seconds)] += 1
    histogram.merge(("a",), counts, 3.65)
    histogram.observe_all(("a",), [0.2])
    text = generate_latest(registry).decode()
    samples = {
        (sample.name, sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    # le is inclusive, as in Prometheus: 0.1 falls in the 0.1 bucket.
    assert samples[("demo_seconds_bucket", "0.1")] == 2
    assert samples[("demo_seconds_bucket", "1.0")] == 4
    assert samples[("demo_seconds_bucket", "+Inf")] == 5
    assert samples[("demo_seconds_count", None)] == 5
    assert samples[("demo_seconds_sum", None)] == pytest.approx(3.85)
    with pytest.raises(ValueError, match="bucket counts"):
        histogram.merge(("a",), [1], 1.0)


async def test_openmetrics_when_asked(proxy: Proxy, client: httpx.AsyncClient) -> None:
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    with trio.fail_after(DEADLINE):
        assert (await client.post(proxy.url + CHAT, json=chat_body())).status_code == 200
        response = await client.get(
            proxy.url + "/metrics", headers={"Accept": "application/openmetrics-text"}
        )
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    families = {family.name: family for family in parse_openmetrics(response.text)}
    requests = families["sluice_requests"]
    assert requests.type == "counter"
    assert any(
        sample.labels == {"model": "fake-model", "status": "200", "endpoint": "chat", "key": "-"}
        and sample.value == 1
        for sample in requests.samples
    )
    assert families["sluice_token_gap_seconds"].type == "histogram"


async def test_a_local_streams_ttft_is_its_first_token_not_its_role_delta(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    """The role delta goes out before the prefill; the time to first token is the prefill's."""
    prefill = 0.3
    loaded = slowed(tiny_loaded_model, 0.0, prefill)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"tiny": {"backend": "local", "path": "unused-preloaded"}},
            local_models={"tiny": loaded},
        )
        response = await client.post(proxy.url + CHAT, json=chat_body("tiny", max_tokens=3))
        assert response.status_code == 200
        await proxy.state.tracker.wait_idle()
        samples = await scrape(client, proxy)
    assert value(samples, "sluice_ttft_seconds_count", model="tiny") == 1
    assert value(samples, "sluice_ttft_seconds_sum", model="tiny") >= prefill


async def test_the_prompt_of_a_request_cut_at_its_deadline_before_its_first_byte_is_for_nobody(
    nursery: trio.Nursery,
) -> None:
    """The upstream read the prompt, then the request's deadline passed before a first token:
    that prefill was work for nobody, counted under its key, model and cause."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=5, interval=0, tokens=5)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            cut = await client.post(
                proxy.url + CHAT, json=chat_body(), headers={"x-sluice-deadline": "0.3"}
            )
            assert (cut.status_code, cut.json()["error"]["code"]) == (504, "deadline_exceeded")
            assert cut.headers["x-should-retry"] == "false"
            await proxy.state.tracker.wait_idle()
            samples = await scrape(client, proxy)
    name = "sluice_tokens_for_nobody_total"
    assert value(samples, name, key="-", model="fake-model", cause="deadline") > 0
    assert value(samples, name, cause="client_left") == 0


@pytest.mark.parametrize(
    ("state", "cause"),
    [
        ({"stalled": True, "deadline_passed": True, "client_gone": True}, "stall"),
        ({"stalled": False, "deadline_passed": True, "client_gone": True}, "deadline"),
        ({"stalled": False, "deadline_passed": False, "client_gone": True}, "client_left"),
        ({"stalled": False, "deadline_passed": False, "client_gone": False}, "shutdown"),
        (
            {
                "stalled": False,
                "deadline_passed": False,
                "client_gone": False,
                "access": SimpleNamespace(guard_waste=1),
            },
            "guard",
        ),
    ],
)
def test_why_tokens_went_to_nobody(state: dict[str, Any], cause: str) -> None:
    state = {"access": None, **state}
    assert waste_cause(SimpleNamespace(**state)) == cause  # type: ignore[arg-type]
