"""Requests into prompts for one loaded model, and one generation alone.

The decoding itself is :mod:`inference.batching`'s, for a sequence alone as in a batch; the
sampling parameters and the draw are :mod:`inference.sampling`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from .batching import run_alone
from .loading import LoadedModel
from .sampling import GenerationResult, PromptError, SamplingParams

log = logging.getLogger("sluice.inference")


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise PromptError(
                    "Only text content parts are supported by this model.",
                    param=f"messages[{index}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise PromptError(
        "Message content must be a string or an array of text parts.",
        param=f"messages[{index}].content",
    )


class Generator:
    """Turns requests into prompts and prompts into tokens, for one loaded model."""

    def __init__(self, loaded: LoadedModel, *, slow_step_seconds: float = 1.0) -> None:
        self.loaded = loaded
        # What the engine calls: the serving forward, or the transformers model itself.
        self.model = loaded.serving
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.slow_step_seconds = slow_step_seconds
        config = getattr(self.model, "config", None)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048) or 2048)

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    def logprob_entry(self, logits: Any, token: int, top: int) -> dict[str, Any]:
        """OpenAI's per-token logprobs entry: the token, its log-probability under the
        (penalized) distribution before temperature, its bytes, and the ``top`` likeliest."""
        import torch

        logprobs = torch.log_softmax(logits.float(), dim=-1)

        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self.decode([token_id])
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        chosen = entry(token, float(logprobs[token]))
        alternatives = []
        if top:
            values, ids = torch.topk(logprobs, top)
            alternatives = [
                entry(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
            ]
        return {**chosen, "top_logprobs": alternatives}

    def chat_prompt(self, messages: Sequence[Any]) -> list[int]:
        conversation = []
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in {"system", "user", "assistant", "tool", "developer"}:
                raise PromptError(f"Unknown role {role!r}.", param=f"messages[{index}].role")
            conversation.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _message_text(message.get("content"), index),
                }
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise PromptError("This model has no chat template; use /v1/completions.")
        text = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return self.text_prompt(str(text))

    def text_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise PromptError("This server takes one prompt per request.", param="prompt")
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise PromptError("'prompt' must be a string.", param="prompt")
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(i) for i in ids]

    def check_length(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        asked: str | None = None,
        prompt_param: str = "messages",
    ) -> SamplingParams:
        """Refuse a prompt that leaves no room, and one whose asked output limit (the field
        named ``asked``; None when the request set none) would run past the context: vLLM's
        check, ``prompt + max_tokens > max_model_len``, up front rather than an answer cut at
        the context's end. A default limit, which the client never chose, is clamped to the
        context that is left, as vLLM fills what is left when none is asked."""
        if not prompt_ids:
            raise PromptError("The prompt is empty.", param="prompt")
        room = self.context_length - len(prompt_ids)
        if room <= 0:
            raise PromptError(
                f"The prompt is {len(prompt_ids)} tokens; this model's context is "
                f"{self.context_length} tokens.",
                code="context_length_exceeded",
                param=prompt_param,
            )
        if params.max_tokens <= room:
            return params
        if asked is None:
            return dataclasses.replace(params, max_tokens=room)
        # OpenAI's own wording, which clients and libraries recognise.
        raise PromptError(
            f"This model's maximum context length is {self.context_length} tokens. However, "
            f"you requested {len(prompt_ids) + params.max_tokens} tokens "
            f"({len(prompt_ids)} in the {prompt_param}, {params.max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_param} or completion "
            f"('{asked}' may be at most {room}).",
            code="context_length_exceeded",
            param=asked,
        )

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        emit: Callable[[str], None],
        checkpoint: Callable[[], None],
        request_id: str = "",
        on_logprob: Callable[[dict[str, Any]], None] | None = None,
    ) -> GenerationResult:
        """One generation in the calling thread, through the batch engine's own steps (so a
        sequence alone and a sequence in a batch are decoded by the same code): ``emit`` gets
        each piece of complete text, ``on_logprob`` (with ``params.logprobs``) each token's
        entry before its text, and ``checkpoint`` runs before each model step."""
        return run_alone(
            self,
            prompt_ids,
            params,
            emit=emit,
            checkpoint=checkpoint,
            request_id=request_id,
            on_logprob=on_logprob,
        )
