"""Long prompts on the local model, through real sockets: a prompt of 3,000 tokens is prefilled in
chunks, so that a client who leaves mid-prefill is let go within one chunk and a short request
sent meanwhile gets its first token within a few; and a request that cannot fit the model's
context with the output it asks for is refused with 400 ``context_length_exceeded`` before it
takes a queue place or a slot.

The model is a tiny random Llama with SmolLM2's tokenizer and its 8,192-token context, slowed
per token of prefill (a forward pass over a chunk costs in proportion to its tokens, as a real
model's does) so that a chunk's time is known and a whole prompt in one pass would be long.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from inference.batching import DEFAULT_PREFILL_CHUNK_ALONE
from inference.loading import LoadedModel
from proxy.backends.local import LocalBackend
from tests.support import (
    PerTokenSlowModel,
    Proxy,
    RawClient,
    chat_body,
    per_token_slowed,
    poll_until,
    slowed,
    start_local_proxy,
)

CHAT = "/v1/chat/completions"
PROMPT_TOKENS = 3000
# Each prompt token a chunk prefills costs this much: a chunk alone (DEFAULT_PREFILL_CHUNK_ALONE
# tokens) takes about half a second, the whole prompt in one pass 12 s.
PER_TOKEN = 0.004
CHUNK = DEFAULT_PREFILL_CHUNK_ALONE * PER_TOKEN
# A decode step of the slowed model.
STEP = 0.005
DEADLINE = 30


@pytest.fixture
def long_context_model(long_context_loaded_model: LoadedModel) -> LoadedModel:
    """The tiny random Llama with SmolLM2's context, slowed per prompt token."""
    return per_token_slowed(long_context_loaded_model, PER_TOKEN, STEP)


def long_body(tokenizer: Any) -> tuple[dict[str, Any], int]:
    """A chat of about PROMPT_TOKENS tokens, and its exact count (its template included)."""
    text = "The river runs to the sea. " * (PROMPT_TOKENS // 7)
    messages = [{"role": "user", "content": text}]
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = len(tokenizer.encode(template, add_special_tokens=False))
    assert PROMPT_TOKENS - 100 <= tokens <= PROMPT_TOKENS + 100, tokens
    return chat_body("tiny", messages=messages, max_tokens=20), tokens


def short_body() -> dict[str, Any]:
    """A short chat whose answer is one token: its end is its first token."""
    return chat_body("tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)


class LongPrompt:
    """A proxy with two slots, and a client whose 3,000-token prompt is being prefilled."""

    def __init__(self, proxy: Proxy, model: PerTokenSlowModel, client: RawClient, tokens: int):
        self.proxy = proxy
        self.local: LocalBackend = proxy.state.local_backends["tiny"]
        self.model = model
        self.client = client
        self.tokens = tokens

    @classmethod
    async def start(cls, nursery: trio.Nursery, loaded: LoadedModel) -> LongPrompt:
        """Returns one and a half chunks into the prompt's prefill."""
        proxy = await start_local_proxy(nursery, loaded, slots=2)
        model = loaded.forward
        # The engine's thread checks its model's cache first (with slots > 1): one pass over
        # one token, which a loaded machine may run after the server is up. Not the prompt's.
        await poll_until(lambda: model.chunks == [1])
        model.chunks.clear()
        body, tokens = long_body(loaded.tokenizer)
        client = await RawClient.post(proxy, CHAT, body)
        await poll_until(lambda: model.chunks)
        long = cls(proxy, model, client, tokens)
        await trio.sleep(1.5 * CHUNK)
        return long

    def prefilling(self) -> bool:
        """Whether the long prompt's prefill is still going on: its sequence has no token."""
        (sequence,) = [seq for seq in self.local._listeners if len(seq.prompt_ids) == self.tokens]
        return sequence.produced == 0

    async def leave(self) -> float:
        """The client leaves mid-prefill: seconds until its sequence is out of the engine and
        its slot free, after checking that no chunk was fed after the one running at the
        close."""
        local, model = self.local, self.model
        chunks = len(model.chunks)
        assert self.prefilling()
        closed_at = await self.client.close()
        await poll_until(lambda: local.active_generations == 0, interval=0.002)
        await local.admission.wait_free()
        seconds = trio.current_time() - closed_at
        assert len(model.chunks) <= chunks + 1
        assert local.engine.sequences == 0 and local.admission.waiting == 0
        return seconds


async def test_a_client_that_leaves_mid_prefill_is_let_go_within_a_chunk(
    nursery: trio.Nursery, long_context_model: LoadedModel
) -> None:
    with trio.fail_after(DEADLINE):
        long = await LongPrompt.start(nursery, long_context_model)
        seconds = await long.leave()
    assert seconds < 2 * CHUNK, f"let go {seconds:.2f} s after its client left"
    # Alone, every chunk is the larger one.
    assert set(long.model.chunks) == {DEFAULT_PREFILL_CHUNK_ALONE}


async def test_a_short_request_gets_its_first_token_while_a_long_prompt_is_prefilled(
    nursery: trio.Nursery, long_context_model: LoadedModel
) -> None:
    with trio.fail_after(DEADLINE):
        long = await LongPrompt.start(nursery, long_context_model)
        sent_at = trio.current_time()
        short = await RawClient.post(long.proxy, CHAT, short_body())
        await short.read_until(b"data: [DONE]")
        first_token = trio.current_time() - sent_at
        assert first_token < 3 * CHUNK, f"first token after {first_token:.2f} s"
        # Let in between two chunks of the long prompt, whose prefill goes on.
        assert long.prefilling()
        seconds = await long.leave()
    assert seconds < 2 * CHUNK, f"let go {seconds:.2f} s after its client left"


# --- past the context ------------------------------------------------------------------------

TINY_CONTEXT = 512  # tiny_loaded_model's
# Each refused request: where it goes, its body, and the field the refusal names.
PAST_THE_CONTEXT = [
    (CHAT, chat_body("tiny", stream=False, max_tokens=TINY_CONTEXT), "max_tokens"),
    (
        CHAT,
        chat_body("tiny", stream=True, max_completion_tokens=TINY_CONTEXT - 5),
        "max_completion_tokens",
    ),
    (
        "/v1/responses",
        {"model": "tiny", "input": "Hi", "max_output_tokens": TINY_CONTEXT},
        "max_output_tokens",
    ),
    # The prompt alone leaves no room.
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 600, "max_tokens": 1}, "prompt"),
]


async def test_a_request_past_the_context_is_refused_before_it_takes_a_queue_place(
    nursery: trio.Nursery, tiny_loaded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decode steps of 50 ms: the holder's 400 tokens take 20 s, far longer than four refusals
    # take on any machine; it is let go as soon as they are answered.
    slow = slowed(tiny_loaded_model, 0.05, prefill_seconds=0.01)
    proxy = await start_local_proxy(nursery, slow, slots=1)
    local = proxy.state.local_backends["tiny"]
    leases: list[Any] = []
    lease = local.admission.lease

    def counted(ticket: Any, *args: Any, **kwargs: Any) -> Any:
        leases.append(ticket)
        return lease(ticket, *args, **kwargs)

    monkeypatch.setattr(local.admission, "lease", counted)
    with trio.fail_after(DEADLINE):
        # The only slot is held by a stream of 20 s.
        holder = await RawClient.post(
            proxy, CHAT, chat_body("tiny", max_tokens=400, ignore_eos=True)
        )
        await holder.read_until(b'"content":"', 3)
        assert len(leases) == 1
        async with httpx.AsyncClient(timeout=DEADLINE, trust_env=False) as client:
            for path, body, param in PAST_THE_CONTEXT:
                # Answered while the holder still holds the only slot (checked below): it
                # waited for no slot. One that queued would get its answer, if any, only after
                # the holder's 20 s, and take a lease.
                response = await client.post(proxy.url + path, json=body)
                assert response.status_code == 400, (path, response.text)
                error = response.json()["error"]
                assert error["code"] == "context_length_exceeded", error
                assert error["type"] == "invalid_request_error"
                assert error["param"] == param
                assert str(TINY_CONTEXT) in error["message"]
                # Nothing of it was queued or held: the holder is alone, and still streaming.
                assert len(leases) == 1, f"{path}: took a queue place"
                assert local.admission.waiting == 0 and local.room.in_flight == 1
                assert local.engine.sequences == 1
            await holder.close()
            await local.admission.wait_free()
            # At the context's edge, it fits; with no max_tokens asked, the model's default
            # (512) is cut to what the context leaves, as vLLM fills what is left.
            slow.forward.step_seconds = 0.0
            body = chat_body("tiny", stream=False, ignore_eos=True)
            prompt_tokens = await client.post(proxy.url + CHAT, json={**body, "max_tokens": 1})
            prompt_tokens = prompt_tokens.json()["usage"]["prompt_tokens"]
            room = TINY_CONTEXT - prompt_tokens
            edge = await client.post(proxy.url + CHAT, json={**body, "max_tokens": room})
            default = await client.post(proxy.url + CHAT, json=body)
    assert edge.status_code == 200, edge.text
    assert edge.json()["usage"]["completion_tokens"] == room
    assert default.status_code == 200, default.text
    assert default.json()["usage"]["completion_tokens"] == room
    assert default.json()["choices"][0]["finish_reason"] == "length"
