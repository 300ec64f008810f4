"""What a request asks of the sampler, and sampling one token: OpenAI's sampling fields read into
:class:`SamplingParams` (with this model's defaults), the penalties applied to the logits as vLLM
applies them, and the draw. Below both the prompts (:mod:`inference.generation`) and the decode
loop (:mod:`inference.batching`), which share these types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chunks import Usage

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
