"""Requests into prompts and sampling parameters, for one loaded model; sampling a token.

The decoding itself is :mod:`inference.batching`'s, for a sequence alone as in a batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chunks import Usage
from .loading import LoadedModel

log = logging.getLogger("sluice.inference")

_SEED_RANGE = 2**63


class PromptError(ValueError):
    """The request cannot be turned into a prompt for this model (the client's fault)."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # vLLM's extension: keep generating past end-of-sequence (benchmarks use it).
    ignore_eos: bool = False
    # OpenAI's: subtracted from a token's logit per time it was generated (frequency) and
    # once if it was at all (presence), -2..2. vLLM's/transformers': logits of tokens seen in
    # the prompt or the output divided (if positive) or multiplied by it, > 0; 1 = off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Chat's logprobs: None = off, else how many alternatives per token (top_logprobs, 0..20).
    logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class GenerationResult:
    finish_reason: str
    usage: Usage
    text: str = ""
    # Seconds per model step; the first is the prompt's prefill.
    step_seconds: list[float] = field(default_factory=list)
    slow_steps: int = 0
    # The stop string that ended it, if one did.
    stop_sequence: str | None = None


MAX_TOP_LOGPROBS = 20


def sampling_from_body(
    body: Mapping[str, Any],
    *,
    default_max_tokens: int,
    default_temperature: float,
    default_repetition_penalty: float = 1.0,
) -> SamplingParams:
    """OpenAI sampling fields (types already validated by the proxy) with this model's defaults."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4:
        raise PromptError("'stop' takes at most 4 sequences.", param="stop")
    if temperature is not None and not 0 <= temperature <= 2:
        raise PromptError("'temperature' must be between 0 and 2.", param="temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise PromptError("'top_p' must be greater than 0 and at most 1.", param="top_p")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise PromptError("'ignore_eos' must be a boolean.", param="ignore_eos")
    penalties = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None:
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not -2 <= value <= 2
            ):
                raise PromptError(f"'{name}' must be a number between -2 and 2.", param=name)
            penalties[name] = float(value)
    repetition = body.get("repetition_penalty", default_repetition_penalty)
    if (
        not isinstance(repetition, int | float)
        or isinstance(repetition, bool)
        or not 0 < repetition <= 10
    ):
        raise PromptError(
            "'repetition_penalty' must be a number greater than 0 (1 = off).",
            param="repetition_penalty",
        )
    logprobs = body.get("logprobs")
    top = body.get("top_logprobs")
    if logprobs not in (None, True, False):
        raise PromptError("'logprobs' must be a boolean.", param="logprobs")
    if top is not None:
        if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise PromptError(
                f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}.",
                param="top_logprobs",
            )
        if logprobs is not True:
            raise PromptError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return SamplingParams(
        **penalties,
        logprobs=(top or 0) if logprobs is True else None,
        repetition_penalty=float(repetition),
        max_tokens=int(max_tokens),
        temperature=default_temperature if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        # Any JSON integer is accepted; torch takes 64 bits, so fold it into range.
        seed=None if body.get("seed") is None else int(body["seed"]) % _SEED_RANGE,
        stop=stops,
        ignore_eos=ignore_eos,
    )


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
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.slow_step_seconds = slow_step_seconds
        config = getattr(self.model, "config", None)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048) or 2048)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    def _logprob_entry(self, logits: Any, token: int, top: int) -> dict[str, Any]:
        """OpenAI's per-token logprobs entry: the token, its log-probability under the
        (penalized) distribution before temperature, its bytes, and the ``top`` likeliest."""
        import torch

        logprobs = torch.log_softmax(logits.float(), dim=-1)

        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self._decode([token_id])
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

    def check_length(self, prompt_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """Refuse prompts that leave no room; clamp max_tokens to the context that is left."""
        if not prompt_ids:
            raise PromptError("The prompt is empty.", param="prompt")
        room = self.context_length - len(prompt_ids)
        if room <= 0:
            raise PromptError(
                f"The prompt is {len(prompt_ids)} tokens; this model's context is "
                f"{self.context_length} tokens.",
                code="context_length_exceeded",
                param="messages",
            )
        if params.max_tokens > room:
            return dataclasses.replace(params, max_tokens=room)
        return params

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
        from .batching import run_alone

        return run_alone(
            self,
            prompt_ids,
            params,
            emit=emit,
            checkpoint=checkpoint,
            request_id=request_id,
            on_logprob=on_logprob,
        )


def penalize(
    logits: Any, params: SamplingParams, prompt_ids: Sequence[int], generated: list[int]
) -> Any:
    """The logits with OpenAI's frequency and presence penalties (over the output) and the
    repetition penalty (over the prompt and the output), as vLLM applies them."""
    import torch

    logits = logits.float().clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *generated}), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if generated and (params.frequency_penalty or params.presence_penalty):
        tokens, counts = torch.unique(torch.tensor(generated, dtype=torch.long), return_counts=True)
        logits[tokens] -= params.frequency_penalty * counts.float() + params.presence_penalty
    return logits


def sample(logits: Any, params: SamplingParams, generator: Any) -> int:
    import torch

    if params.temperature <= 0:
        return int(torch.argmax(logits).item())
    logits = logits.float()
    # Shift so the best logit is 0 before dividing: a tiny temperature then sends the others
    # to -inf (probability 0) instead of overflowing everything to inf (NaN probabilities).
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of tokens whose probability reaches top_p (always >= 1 token).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > params.top_p
        sorted_probs[outside] = 0.0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
