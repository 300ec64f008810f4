"""What each model endpoint answers, in the shape vLLM serves it, decided before any byte is
sent; a streamed answer also precomputes its frames (``wire.Frames``).

Endpoints, each in the shape vLLM serves it (``POST`` unless said otherwise):

* ``/v1/chat/completions``, ``/v1/completions``: chunks as ``data:`` lines and ``data: [DONE]``
  when streamed, the completion object when not.
* ``/v1/responses`` (OpenAI Responses): ``input`` a string or a list of items. Streamed, typed
  events (``event: <type>`` and ``data:`` with ``type`` and ``sequence_number``, no
  ``[DONE]``): ``response.created`` and ``response.in_progress`` with the headers,
  ``response.output_item.added`` and ``response.content_part.added`` with token 0, one
  ``response.output_text.delta`` per token, then ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and ``response.completed``;
  a ``max_output_tokens`` at or under the planned tokens stops there and ends with
  ``response.incomplete`` (``incomplete_details.reason`` ``max_output_tokens``).
* ``/v1/messages`` (Anthropic Messages; ``max_tokens`` required): ``message_start``,
  ``content_block_start`` and ``ping`` with token 0, one ``content_block_delta``
  (``text_delta``) per token, then ``content_block_stop``, ``message_delta`` (``stop_reason``
  ``end_turn`` or ``max_tokens``) and ``message_stop``. Its errors, ``mode=status`` included,
  are in Anthropic's shape, ``{"type": "error", "error": {"type": ..., "message": ...}}``.
* ``/v1/embeddings`` and ``/pooling``: ``embedding_vector(item)`` per input (8 floats from a
  SHA-256 of it, exact in float32), as floats or, with ``encoding_format: "base64"`` (the
  OpenAI SDK's default), little-endian float32 in base64.
* ``/tokenize``, ``/detokenize``: a word of the fake's vocabulary ``WORDS`` is its index, any
  other a CRC-32 of it; token ``t`` reads back as ``token_text(t)``.
* ``/v1/rerank`` (also ``/rerank``, ``/v2/rerank``), ``/v1/score`` (also ``/score``):
  ``relevance_score(query, document)``, a number in [0, 1) from a SHA-256 of the pair.
* ``/v1/audio/transcriptions``: ``multipart/form-data`` with ``model``, ``file``, optional
  ``stream`` (and ``fake``, as JSON text); the answer carries ``sha256``/``bytes`` of the exact
  request body received and ``file_sha256`` of the file part, so a test can prove a proxy
  relayed the body intact. Streamed: ``transcription.chunk`` events, the digests on the last.
* ``GET /v1/models``, ``GET /health``; ``/_fake/requests`` lists the records as JSON.
* ``GET /metrics``: vLLM's load gauges in Prometheus text (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) and its prefix-cache counters
  (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, in blocks here);
  ``metrics_text`` replaces the body, ``metrics_status`` the status. Not recorded.

Every ``POST`` endpoint follows the schedule (a non-generating one answers at ``ttft``) and
takes the ``"fake"`` steering and its fault modes; each request gets a ``RequestRecord`` with
its ``path``, the ``model`` it named and, for a multipart body, its text fields (``form``).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

from proxy.testing.fake_upstream.behaviours import Invalid, Plan, check_int
from proxy.testing.fake_upstream.content import (
    EMBEDDING_DIMENSIONS,
    MAX_MODEL_LEN,
    TOKEN_JSON,
    embedding_vector,
    message_texts,
    prompt_tokens,
    relevance_score,
    token_text,
)
from proxy.testing.fake_upstream.wire import Answer, EventFrames, Frames, compact_json, sse_event

_CHAT_PATH: Final = "/v1/chat/completions"
_COMPLETIONS_PATH: Final = "/v1/completions"
_RESPONSES_PATH: Final = "/v1/responses"
MESSAGES_PATH: Final = "/v1/messages"
TRANSCRIPTIONS_PATH: Final = "/v1/audio/transcriptions"


@dataclass(frozen=True, slots=True)
class _Completion:
    """What one completion request asks for, decided before any byte is sent."""

    chat: bool
    stream: bool
    model: str
    tokens: int
    finish_reason: str
    include_usage: bool
    prompt_tokens: int
    response_id: str
    created: int
    usage_blocks: bool = True
    # A continuation (see _continued_from): the answer goes on from this token.
    first_token: int = 0

    @classmethod
    def build(
        cls, body: dict[str, Any], plan: Plan, *, chat: bool, default_model: str, number: int
    ) -> _Completion:
        """Raise Invalid on what vLLM would reject with a 400."""
        model = body.get("model", default_model)
        if not isinstance(model, str):
            raise Invalid('"model" must be a string')
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise Invalid('"stream" must be a boolean')
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        first_token = _continued_from(body, chat=chat, planned=plan.tokens)
        tokens, finish_reason = max(0, plan.tokens - first_token), "stop"
        for name in ("max_tokens", "max_completion_tokens"):
            limit = body.get(name)
            if limit is None:
                continue
            check_int(name, limit, 0)
            # vLLM says "length" whenever the limit ended generation, even at exactly the
            # natural length: the end-of-sequence token would have been one more.
            if limit <= tokens:
                tokens, finish_reason = limit, "length"
        if chat:
            if not isinstance(body.get("messages"), list):
                raise Invalid('"messages" must be a list')
        elif "prompt" not in body:
            raise Invalid('"prompt" is required')
        return cls(
            chat=chat,
            stream=stream,
            model=model,
            tokens=tokens,
            finish_reason=finish_reason,
            include_usage=include_usage and plan.usage,
            prompt_tokens=_count_prompt_tokens(body),
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{number}",
            created=int(time.time()),
            usage_blocks=plan.usage,
            first_token=first_token,
        )

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    def whole_body(self) -> bytes:
        first = self.first_token
        text = "".join(token_text(first + i) for i in range(self.tokens))
        choice: dict[str, Any]
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = self.finish_reason
        obj = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }
        if not self.usage_blocks:
            del obj["usage"]
        return json.dumps(obj, separators=(",", ":")).encode()

    def frames(self, *, chunked: bool) -> Frames:
        return _StreamFrames(self, chunked=chunked)


class _StreamFrames(Frames):
    """A chat or text completion stream, precomputed once per request so a token costs one
    lookup."""

    __slots__ = ("tokens",)

    def __init__(self, c: _Completion, *, chunked: bool) -> None:
        super().__init__(chunked=chunked)
        ident = json.dumps(c.response_id)
        model = json.dumps(c.model)
        kind = "chat.completion.chunk" if c.chat else "text_completion"
        prefix = f'data: {{"id":{ident},"object":"{kind}","created":{c.created},"model":{model},'
        choice = (prefix + '"choices":[{"index":0,').encode()
        open_field = b'"delta":{"content":' if c.chat else b'"text":'
        close_field = b"}" if c.chat else b""
        ending = b',"logprobs":null,"finish_reason":null}]}\n\n'
        words = len(TOKEN_JSON)
        first = c.first_token
        self.tokens = tuple(
            self.frame(choice + open_field + TOKEN_JSON[(first + i) % words] + close_field + ending)
            for i in range(max(1, min(c.tokens, words)))
        )
        # The role chunk goes with token 0, as vLLM sends it with the first output.
        if c.chat:
            role = b'"delta":{"role":"assistant","content":""}'
            self.extra[0] = self.frame(choice + role + ending)
        empty = b'"delta":{}' if c.chat else b'"text":""'
        finish = f',"logprobs":null,"finish_reason":"{c.finish_reason}"}}]}}\n\n'.encode()
        tail = [choice + empty + finish]
        if c.include_usage:
            usage = compact_json(c.usage())
            tail.append(f'{prefix}"choices":[],"usage":{usage}}}\n\n'.encode())
        tail.append(b"data: [DONE]\n\n")
        self._set_tail(tail)

    def token(self, i: int) -> bytes:
        data = self.tokens[i % len(self.tokens)]
        extra = self.extra.get(i)
        return data if extra is None else extra + data


def _continued_from(body: dict[str, Any], *, chat: bool, planned: int) -> int:
    """Where a continuation's answer goes on from, as vLLM's would: the tokens of the answer so
    far, which a chat request sends as its final assistant message with
    ``continue_final_message`` (refused, as vLLM refuses it, with ``add_generation_prompt``
    true, or with no assistant message last), and a completions request appends to its prompt
    (the longest run of this fake's own answer that the prompt ends with). 0: not one."""
    if chat:
        if body.get("continue_final_message") is not True:
            return 0
        if body.get("add_generation_prompt", True) is not False:
            raise Invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise Invalid("continue_final_message needs an assistant message last")
        content = last.get("content")
        return len(content.split()) if isinstance(content, str) else 0
    prompt = body.get("prompt")
    # Every token of this fake's answers is a word and a space: anything else ends no answer.
    if not isinstance(prompt, str) or not prompt.endswith(" "):
        return 0
    ends: list[int] = []
    total = 0
    for index in range(planned):
        total += len(token_text(index))
        if total > len(prompt):
            break
        ends.append(total)
    answer = _generated_text(len(ends))
    for length in range(len(ends), 0, -1):
        if prompt.endswith(answer[: ends[length - 1]]):
            return length
    return 0


def _count_prompt_tokens(body: dict[str, Any]) -> int:
    """Whitespace-separated words of the prompt: deterministic, and cheap to check in a test."""
    texts = message_texts(body.get("messages"))
    count = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, int):
                count += 1  # a pre-tokenized prompt
            elif isinstance(item, list):
                count += len(item)
    return count + sum(len(text.split()) for text in texts)


def _count_words(texts: Sequence[str]) -> int:
    return sum(len(text.split()) for text in texts)


def _model(body: Mapping[str, Any], default_model: str) -> str:
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise Invalid('"model" must be a string')
    return model


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise Invalid('"stream" must be a boolean')
    return stream


def _limit(body: Mapping[str, Any], name: str, planned: int) -> tuple[int, bool]:
    """Tokens to generate under the limit ``name``, and whether the limit ended generation.

    As vLLM: a limit at exactly the natural length still ends it (the end-of-sequence token
    would have been one more).
    """
    limit = body.get(name)
    if limit is None:
        return planned, False
    check_int(name, limit, 0)
    return (limit, True) if limit <= planned else (planned, False)


@dataclass(frozen=True, slots=True)
class _Static:
    """A whole JSON answer of an endpoint that generates nothing (embeddings, tokenize, ...)."""

    body: bytes
    stream: bool = False
    tokens: int = 0

    def whole_body(self) -> bytes:
        return self.body

    def frames(self, *, chunked: bool) -> Frames:
        raise AssertionError("a static answer is never streamed")


def _generated_text(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


@dataclass(frozen=True, slots=True)
class _Responses:
    """An OpenAI Responses API answer (``POST /v1/responses``)."""

    stream: bool
    model: str
    tokens: int
    incomplete: bool
    prompt_tokens: int
    number: int
    created: int
    max_output_tokens: int | None
    instructions: str | None
    usage_blocks: bool = True

    @classmethod
    def build(cls, body: dict[str, Any], plan: Plan, default_model: str, number: int) -> _Responses:
        model = _model(body, default_model)
        stream = _stream_flag(body)
        items = body.get("input")
        if isinstance(items, str):
            texts = [items]
        elif isinstance(items, list):
            texts = message_texts(items)
        else:
            raise Invalid('"input" must be a string or a list of items')
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise Invalid('"instructions" must be a string')
        if instructions:
            texts.append(instructions)
        tokens, incomplete = _limit(body, "max_output_tokens", plan.tokens)
        return cls(
            stream=stream,
            model=model,
            tokens=tokens,
            incomplete=incomplete,
            prompt_tokens=_count_words(texts),
            number=number,
            created=int(time.time()),
            max_output_tokens=body.get("max_output_tokens"),
            instructions=instructions,
            usage_blocks=plan.usage,
        )

    @property
    def item_id(self) -> str:
        return f"msg_{self.number}"

    @property
    def status(self) -> str:
        return "incomplete" if self.incomplete else "completed"

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": self.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    def response(self, *, final: bool) -> dict[str, Any]:
        """The response object: as it ends, or (not ``final``) as it starts."""
        if final:
            status = self.status
            output = [self._item(status, [self._part(_generated_text(self.tokens))])]
        else:
            status, output = "in_progress", []
        details = {"reason": "max_output_tokens"} if final and self.incomplete else None
        return {
            "id": f"resp_{self.number}",
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": details,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": None,
            "metadata": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": None,
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": self._usage() if final and self.usage_blocks else None,
            "user": None,
        }

    def whole_body(self) -> bytes:
        return compact_json(self.response(final=True)).encode()

    def frames(self, *, chunked: bool) -> Frames:
        n = self.tokens
        text = _generated_text(n)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            return sse_event(kind, {"type": kind, "sequence_number": next(seq), **fields})

        start = self.response(final=False)
        head = [
            event("response.created", response=start),
            event("response.in_progress", response=start),
        ]
        first = [
            event(
                "response.output_item.added",
                output_index=0,
                item=self._item("in_progress", []),
            ),
            event("response.content_part.added", **where, part=self._part("")),
        ]
        delta = "response.output_text.delta"
        ids = compact_json(where)[1:-1]
        before = f'event: {delta}\ndata: {{"type":"{delta}",{ids},"logprobs":[],"delta":'
        # The deltas take the numbers from here on; `event` numbers the tail after them.
        first_delta = next(seq)
        seq = itertools.count(first_delta + n)
        final = self.response(final=True)
        ending = "response.incomplete" if self.incomplete else "response.completed"
        tail = [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=self._part(text)),
            event("response.output_item.done", output_index=0, item=final["output"][0]),
            event(ending, response=final),
        ]
        return EventFrames(
            chunked=chunked,
            head=head,
            first=first,
            before=before.encode(),
            after=b"}\n\n",
            tail=tail,
            numbered=(b',"sequence_number":', first_delta),
        )


@dataclass(frozen=True, slots=True)
class _Messages:
    """An Anthropic Messages answer (``POST /v1/messages``)."""

    stream: bool
    model: str
    tokens: int
    stop_reason: str
    prompt_tokens: int
    number: int
    usage_blocks: bool = True

    @classmethod
    def build(cls, body: dict[str, Any], plan: Plan, default_model: str, number: int) -> _Messages:
        model = _model(body, default_model)
        stream = _stream_flag(body)
        if body.get("max_tokens") is None:
            raise Invalid('"max_tokens" is required')
        check_int("max_tokens", body["max_tokens"], 1)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise Invalid('"messages" must be a list')
        texts = message_texts(messages)
        system = body.get("system")
        if isinstance(system, str):
            texts.append(system)
        elif isinstance(system, list):
            texts.extend(message_texts([{"content": system}]))
        tokens, capped = _limit(body, "max_tokens", plan.tokens)
        return cls(
            stream=stream,
            model=model,
            tokens=tokens,
            stop_reason="max_tokens" if capped else "end_turn",
            prompt_tokens=_count_words(texts),
            number=number,
            usage_blocks=plan.usage,
        )

    def message(self, *, final: bool) -> dict[str, Any]:
        """The message object: whole, or (not ``final``) as ``message_start`` carries it."""
        content = [{"type": "text", "text": _generated_text(self.tokens)}] if final else []
        message = {
            "id": f"msg_{self.number}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason if final else None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.tokens if final else 0,
            },
        }
        if not self.usage_blocks:
            del message["usage"]
        return message

    def whole_body(self) -> bytes:
        return compact_json(self.message(final=True)).encode()

    def frames(self, *, chunked: bool) -> Frames:
        def event(kind: str, **fields: Any) -> bytes:
            return sse_event(kind, {"type": kind, **fields})

        first = [
            event("message_start", message=self.message(final=False)),
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            event("ping"),
        ]
        delta = "content_block_delta"
        before = f'event: {delta}\ndata: {{"type":"{delta}","index":0,'
        before += '"delta":{"type":"text_delta","text":'
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": self.tokens}
        ending: dict[str, Any] = {"delta": {"stop_reason": self.stop_reason, "stop_sequence": None}}
        if self.usage_blocks:
            ending["usage"] = usage
        tail = [
            event("content_block_stop", index=0),
            event("message_delta", **ending),
            event("message_stop"),
        ]
        return EventFrames(
            chunked=chunked,
            head=[],
            first=first,
            before=before.encode(),
            after=b"}}\n\n",
            tail=tail,
        )


@dataclass(frozen=True, slots=True)
class Upload:
    """A multipart/form-data body, parsed: its text fields and its file parts' contents."""

    fields: dict[str, str]
    files: dict[str, bytes]

    @classmethod
    def parse(cls, content_type: str, body: bytes) -> Upload:
        kind, options = parse_options_header(content_type)
        boundary = options.get("boundary")
        if kind != "multipart/form-data" or not boundary:
            raise Invalid("the body must be multipart/form-data with a boundary")
        fields: dict[str, str] = {}
        files: dict[str, bytes] = {}
        decoder = MultipartDecoder(boundary.encode("latin-1"))
        decoder.receive_data(body)
        decoder.receive_data(None)
        part: Field | File | None = None
        data = bytearray()
        try:
            while True:
                event = decoder.next_event()
                if isinstance(event, Field | File):
                    part, data = event, bytearray()
                elif isinstance(event, Data):
                    data += event.data
                    if not event.more_data and part is not None:
                        if isinstance(part, File):
                            files[part.name] = bytes(data)
                        else:
                            fields[part.name] = data.decode()
                        part = None
                elif isinstance(event, Epilogue | NeedData):
                    break
        except Exception as exc:  # noqa: BLE001 - any parser failure is the client's: a 400
            raise Invalid(f"malformed multipart/form-data body: {exc}") from None
        return cls(fields, files)


def _form_flag(fields: Mapping[str, str], name: str) -> bool:
    value = fields.get(name, "false").strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off", ""):
        return False
    raise Invalid(f'"{name}" must be a boolean')


@dataclass(frozen=True, slots=True)
class Transcription:
    """A transcription (``POST /v1/audio/transcriptions``): deterministic text, and digests of
    what arrived so a test can prove the body was relayed intact."""

    stream: bool
    model: str
    tokens: int
    number: int
    created: int
    digests: dict[str, Any]

    @classmethod
    def build(
        cls, upload: Upload, raw: bytes, plan: Plan, default_model: str, number: int
    ) -> Transcription:
        audio = upload.files.get("file")
        if audio is None:
            raise Invalid('"file" is required (a file part)')
        digests = {
            "sha256": hashlib.sha256(raw).hexdigest(),
            "bytes": len(raw),
            "file_sha256": hashlib.sha256(audio).hexdigest(),
        }
        return cls(
            stream=_form_flag(upload.fields, "stream"),
            model=upload.fields.get("model") or default_model,
            tokens=plan.tokens,
            number=number,
            created=int(time.time()),
            digests=digests,
        )

    def whole_body(self) -> bytes:
        return compact_json({"text": _generated_text(self.tokens), **self.digests}).encode()

    def frames(self, *, chunked: bool) -> Frames:
        ident = compact_json(f"trsc-{self.number}")
        prefix = (
            f'data: {{"id":{ident},"object":"transcription.chunk","created":{self.created},'
            f'"model":{compact_json(self.model)},"choices":[{{'
        )
        finish = compact_json({"delta": {}, "finish_reason": "stop", "stop_reason": None})
        last = f"{prefix}{finish[1:]}],{compact_json(self.digests)[1:]}\n\n"
        return EventFrames(
            chunked=chunked,
            head=[],
            first=[],
            before=(prefix + '"delta":{"content":').encode(),
            after=b'},"finish_reason":null,"stop_reason":null}]}\n\n',
            tail=[last.encode(), b"data: [DONE]\n\n"],
        )


def _inputs(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The ``input`` of an embeddings or pooling request: a text, texts, or token arrays."""
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [list(value)]
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(
            isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            for v in value
        ):
            return [list(v) for v in value]
    raise Invalid('"input" must be a string, a list of strings, or token arrays')


def _pooled_usage(items: Sequence[str | list[int]]) -> dict[str, Any]:
    n = sum(len(item.split()) if isinstance(item, str) else len(item) for item in items)
    return {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _vectors(body: Mapping[str, Any], items: Sequence[str | list[int]]) -> list[Any]:
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise Invalid('"encoding_format" must be "float" or "base64"')
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = EMBEDDING_DIMENSIONS
    check_int("dimensions", dimensions, 1, 32)
    vectors: list[Any] = []
    for item in items:
        vector = embedding_vector(item, dimensions)
        if encoding == "base64":
            packed = struct.pack(f"<{len(vector)}f", *vector)
            vectors.append(base64.b64encode(packed).decode())
        else:
            vectors.append(vector)
    return vectors


def _embeddings(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    model = _model(body, default_model)
    items = _inputs(body)
    data = [
        {"index": i, "object": "embedding", "embedding": vector}
        for i, vector in enumerate(_vectors(body, items))
    ]
    answer = {
        "id": f"embd-{number}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _pooled_usage(items),
    }
    return _Static(compact_json(answer).encode())


def _pooling(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    model = _model(body, default_model)
    items = _inputs(body)
    data = [
        {"index": i, "object": "pooling", "data": vector}
        for i, vector in enumerate(_vectors(body, items))
    ]
    answer = {
        "id": f"pool-{number}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _pooled_usage(items),
    }
    return _Static(compact_json(answer).encode())


def _tokenize(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    _model(body, default_model)
    tokens = prompt_tokens(body) if not isinstance(body.get("prompt"), list) else None
    if tokens is None:
        raise Invalid('"prompt" (a string) or "messages" (a list) is required')
    answer = {
        "count": len(tokens),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": tokens,
        "token_strs": None,
    }
    return _Static(compact_json(answer).encode())


def _detokenize(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    _model(body, default_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise Invalid('"tokens" must be a list of token ids')
    return _Static(compact_json({"prompt": "".join(token_text(t) for t in tokens)}).encode())


def _document_text(document: object) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return str(document["text"])
    raise Invalid('each document must be a string or {"text": ...}')


def _rerank(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    model = _model(body, default_model)
    query = body.get("query")
    documents = body.get("documents")
    if not isinstance(query, str):
        raise Invalid('"query" must be a string')
    if not isinstance(documents, list):
        raise Invalid('"documents" must be a list')
    texts = [_document_text(d) for d in documents]
    top_n = body.get("top_n")
    if top_n is None or top_n == 0:
        top_n = len(texts)
    check_int("top_n", top_n, 0)
    scores = [relevance_score(query, text) for text in texts]
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    results = [
        {"index": i, "document": {"text": texts[i]}, "relevance_score": scores[i]} for i in order
    ]
    words = _count_words([query]) * len(texts) + _count_words(texts)
    answer = {
        "id": f"rerank-{number}",
        "model": model,
        "usage": {"total_tokens": words},
        "results": results[:top_n],
    }
    return _Static(compact_json(answer).encode())


def _score(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    model = _model(body, default_model)
    sides: list[list[str]] = []
    for name in ("text_1", "text_2"):
        value = body.get(name)
        if isinstance(value, str):
            sides.append([value])
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            sides.append(list(value))
        else:
            raise Invalid(f'"{name}" must be a string or a non-empty list of strings')
    left, right = sides
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise Invalid('"text_1" and "text_2" must pair up: one to many, or as many each')
    data = [
        {"index": i, "object": "score", "score": relevance_score(a, b)}
        for i, (a, b) in enumerate(zip(left, right, strict=True))
    ]
    words = _count_words(left) + _count_words(right)
    answer = {
        "id": f"score-{number}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": words,
            "total_tokens": words,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
    return _Static(compact_json(answer).encode())


def _chat(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    return _Completion.build(body, plan, chat=True, default_model=default_model, number=number)


def _text_completion(body: dict[str, Any], plan: Plan, default_model: str, number: int) -> Answer:
    return _Completion.build(body, plan, chat=False, default_model=default_model, number=number)


_Builder = Callable[[dict[str, Any], Plan, str, int], Answer]

# The model endpoints that take a JSON body; the transcription endpoint takes multipart.
JSON_ENDPOINTS: Final[dict[str, _Builder]] = {
    _CHAT_PATH: _chat,
    _COMPLETIONS_PATH: _text_completion,
    _RESPONSES_PATH: _Responses.build,
    MESSAGES_PATH: _Messages.build,
    "/v1/embeddings": _embeddings,
    "/pooling": _pooling,
    "/tokenize": _tokenize,
    "/detokenize": _detokenize,
    "/v1/rerank": _rerank,
    "/rerank": _rerank,
    "/v2/rerank": _rerank,
    "/v1/score": _score,
    "/score": _score,
}
