"""Every OpenAI parameter is honoured or refused by a local model, never silently ignored: the
penalties, n and chat's logprobs are applied; the legacy completions' logprobs, tools,
response_format (and the Responses and Messages
APIs' tools) get 400 unsupported_parameter naming the parameter."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from inference import sampling_from_body
from tests.support import DEADLINE, chat_body, sse_payloads, start_proxy

REFUSED = [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": {}}]}, "tools"),
]


def body_for(path: str, extra: dict[str, Any]) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return chat_body("tiny", stream=False, max_tokens=3, **extra)
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": "Hi", "max_tokens": 3, **extra}
    if path == "/v1/responses":
        return {"model": "tiny", "input": "Hi", "max_output_tokens": 3, **extra}
    return {
        "model": "tiny",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }


async def test_what_a_local_model_cannot_do_is_refused_by_name(
    nursery: trio.Nursery, tiny_loaded_model: Any
) -> None:
    proxy = await start_proxy(
        nursery,
        {"tiny": {"backend": "local", "path": "preloaded", "default_temperature": 0.0}},
        local_models={"tiny": tiny_loaded_model},
    )
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            answers = [
                (param, await client.post(proxy.url + path, json=body_for(path, extra)))
                for path, extra, param in REFUSED
            ]
            fine = await client.post(
                proxy.url + "/v1/chat/completions",
                json=body_for(
                    "/v1/chat/completions",
                    {
                        "n": 1,
                        "logprobs": False,
                        "response_format": {"type": "text"},
                        "frequency_penalty": 0.5,
                        "presence_penalty": 0.5,
                        "repetition_penalty": 1.2,
                    },
                ),
            )
    for param, response in answers:
        assert response.status_code == 400, (param, response.text)
        error = response.json()
        error = error.get("error", error)
        assert param in error["message"]
        if "code" in error:
            assert error["code"] == "unsupported_parameter" and error["param"] == param
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_penalties_are_checked(body: dict[str, Any], param: str) -> None:
    from inference.sampling import PromptError

    with pytest.raises(PromptError) as raised:
        sampling_from_body(body, default_max_tokens=5, default_temperature=0.0)
    assert raised.value.param == param


def test_the_penalties_move_the_logits_as_vllm_applies_them() -> None:
    import torch

    from inference.sampling import SamplingParams, penalize

    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    params = SamplingParams(
        max_tokens=1, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0
    )
    # Token 0 is in the prompt, token 2 was generated twice, token 3 never appeared.
    moved = penalize(logits, params, prompt_ids=[0], generated=[2, 2])
    assert moved.tolist() == [1.0, 1.0, -2.0 - 2 * 0.5 - 0.25, 0.5]
    assert logits.tolist() == [2.0, 1.0, -1.0, 0.5]  # the model's own tensor is untouched


async def test_n_choices_streamed_and_whole(nursery: trio.Nursery, tiny_loaded_model: Any) -> None:
    proxy = await start_proxy(
        nursery,
        {"tiny": {"backend": "local", "path": "preloaded", "default_temperature": 1.0}},
        local_models={"tiny": tiny_loaded_model},
    )
    body = chat_body("tiny", max_tokens=4, n=3, seed=7)
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            whole = await client.post(
                proxy.url + "/v1/chat/completions", json={**body, "stream": False}
            )
            streamed = await client.post(
                proxy.url + "/v1/chat/completions",
                json={**body, "stream_options": {"include_usage": True}},
            )
            too_many = await client.post(proxy.url + "/v1/chat/completions", json={**body, "n": 9})
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2]
    texts = [choice["message"]["content"] for choice in choices]
    assert len(set(texts)) > 1  # each choice has its own seed
    assert 3 <= whole.json()["usage"]["completion_tokens"] <= 12
    payloads = [json.loads(p) for p in sse_payloads(streamed.text) if p != "[DONE]"]
    streamed_texts = ["", "", ""]
    for chunk in payloads:
        for choice in chunk["choices"]:
            streamed_texts[choice["index"]] += choice.get("delta", {}).get("content") or ""
    assert streamed_texts == texts  # the same seeds, the same choices
    assert payloads[-1]["usage"]["completion_tokens"] == whole.json()["usage"]["completion_tokens"]
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


async def test_chat_logprobs_streamed_and_whole(
    nursery: trio.Nursery, tiny_loaded_model: Any
) -> None:
    import openai.types.chat

    proxy = await start_proxy(
        nursery,
        {"tiny": {"backend": "local", "path": "preloaded", "default_temperature": 0.0}},
        local_models={"tiny": tiny_loaded_model},
    )
    body = chat_body("tiny", max_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True)
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            whole = await client.post(
                proxy.url + "/v1/chat/completions", json={**body, "stream": False}
            )
            streamed = await client.post(proxy.url + "/v1/chat/completions", json=body)
            orphan = await client.post(
                proxy.url + "/v1/chat/completions",
                json={**body, "logprobs": False, "stream": False},
            )
    assert whole.status_code == 200, whole.text
    parsed = openai.types.chat.ChatCompletion.model_validate(whole.json())
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    entries = logprobs.content
    assert len(entries) == parsed.usage.completion_tokens == 5  # type: ignore[union-attr]
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the likeliest.
        assert entry.logprob == entry.top_logprobs[0].logprob
    assert "".join(entry.token for entry in entries) == parsed.choices[0].message.content
    chunks = [json.loads(p) for p in sse_payloads(streamed.text) if p != "[DONE]"]
    streamed_entries = [
        entry
        for chunk in chunks
        for choice in chunk["choices"]
        for entry in ((choice.get("logprobs") or {}).get("content") or [])
    ]
    assert [e["token"] for e in streamed_entries] == [e.token for e in entries]
    assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "top_logprobs"
