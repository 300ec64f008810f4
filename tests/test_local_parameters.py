"""Every OpenAI parameter is honoured or refused by a local model, never silently ignored: the
penalties are applied; n, logprobs, tools, response_format (and the Responses and Messages
APIs' tools) get 400 unsupported_parameter naming the parameter."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from inference import sampling_from_body
from tests.support import DEADLINE, chat_body, start_proxy

REFUSED = [
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
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
    from inference.generation import PromptError

    with pytest.raises(PromptError) as raised:
        sampling_from_body(body, default_max_tokens=5, default_temperature=0.0)
    assert raised.value.param == param


def test_the_penalties_move_the_logits_as_vllm_applies_them() -> None:
    import torch

    from inference.generation import SamplingParams, _penalize

    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    params = SamplingParams(
        max_tokens=1, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0
    )
    # Token 0 is in the prompt, token 2 was generated twice, token 3 never appeared.
    moved = _penalize(logits, params, prompt_ids=[0], generated=[2, 2])
    assert moved.tolist() == [1.0, 1.0, -2.0 - 2 * 0.5 - 0.25, 0.5]
    assert logits.tolist() == [2.0, 1.0, -1.0, 0.5]  # the model's own tensor is untouched
