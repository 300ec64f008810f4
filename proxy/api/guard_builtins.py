"""The built-in guards a ``[[guards]]`` table names by ``use``: ``regex``, ``webhook`` and
``model``. Each is a factory of the table (its options checked here: an unknown option, a
pattern that does not compile, a model not served is a start-up error naming the guard) and
the services it may need (:class:`GuardServices`: the served config's backends, an HTTP client
made as the upstreams' are).

* ``regex``: ``deny`` (refused when any matches) and ``allow`` (refused unless one matches)
  lists, on the text of the stage (the prompt, or an output window whole across events);
* ``webhook``: POSTs the stage's text and the request's facts as JSON to a policy service
  (``url``), bounded by the guard's ``timeout``, and reads ``{"allow": bool, "reason": str}``;
  a client that leaves cancels the call, which closes its connection (nothing is left open to
  the service);
* ``model``: asks a model this server serves (a Llama Guard on vLLM, the local model), with a
  prompt template, and refuses when the ``refuse`` pattern matches its answer's first line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import trio

from proxy.backends.base import Backend
from proxy.backends.upstream.transports import ConnectionSettings
from proxy.config import Config, GuardConfig
from proxy.guards import Outcome, Prompt, Refusal, Window
from proxy.protocol.api_request import parse_api_request
from proxy.protocol.openai import Endpoint
from proxy.relay.guarded import GuardCall
from proxy.relay.state import Phase

# Connections to one policy service at most; requests past it wait in a trio.Semaphore, never
# inside httpcore's pool (httpcore #1093: a request cancelled while it waits for a pool slot
# leaks a connection).
WEBHOOK_CONNECTIONS = 32
# A policy service's or a guard model's answer is read up to this many bytes.
MAX_ANSWER_BYTES = 1024 * 1024
# What a refusal tells the client, unless the options say otherwise.
REFUSED = "the request was refused by a policy"


class GuardServices:
    """What built-in guards use of the served config: its backends (the ``model`` guard) and
    HTTP clients (the ``webhook`` guard), made when first used and closed with the config."""

    def __init__(self, config: Config, env: Mapping[str, str], backends: Mapping[str, Backend]):
        self.config = config
        self.env = env
        self.backends = backends
        self._clients: list[httpx.AsyncClient] = []

    def client(self, url: str, timeout: float) -> httpx.AsyncClient:
        """A client for ``url``, with [upstream]'s proxy and TLS settings (as a replica's
        connections are made), at most WEBHOOK_CONNECTIONS connections."""
        settings = ConnectionSettings.resolve(url, self.config.upstream, self.env)
        client = httpx.AsyncClient(
            trust_env=False,
            timeout=timeout,
            verify=settings.ssl_context(alpn=["http/1.1"]),
            proxy=settings.proxy,
            follow_redirects=False,
            limits=httpx.Limits(
                max_connections=WEBHOOK_CONNECTIONS,
                max_keepalive_connections=WEBHOOK_CONNECTIONS,
            ),
        )
        self._clients.append(client)
        return client

    async def aclose(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.aclose()


def _options(guard: GuardConfig, known: tuple[str, ...]) -> dict[str, Any]:
    options = dict(guard.options)
    for name in options:
        if name not in known:
            raise ValueError(
                f"unknown option {name!r} in [guards.options]; {guard.use}'s are: "
                f"{', '.join(known)}"
            )
    return options


def _strings(options: Mapping[str, Any], name: str) -> list[str]:
    value = options.get(name, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"option {name!r} must be an array of strings")
    return value


def _string(options: Mapping[str, Any], name: str, default: str | None = None) -> str:
    value = options.get(name, default)
    if not isinstance(value, str) or not value:
        raise ValueError(f"option {name!r} must be a non-empty string")
    return value


def text_of(context: object) -> str:
    """The text a built-in reads at the stage of ``context``: the prompt, the window whole;
    nothing of an ``after`` hook's outcome."""
    if isinstance(context, Prompt | Window):
        return context.text
    return ""


def regex_guard(guard: GuardConfig, services: GuardServices) -> GuardCall:
    options = _options(guard, ("deny", "allow", "ignore_case", "message"))
    flags = re.IGNORECASE if options.get("ignore_case", False) is True else 0
    compiled: dict[str, list[re.Pattern[str]]] = {}
    for name in ("deny", "allow"):
        patterns = []
        for index, pattern in enumerate(_strings(options, name), start=1):
            try:
                patterns.append(re.compile(pattern, flags))
            except re.error as error:
                raise ValueError(
                    f"{name} pattern {index} ({pattern!r}) is no regex: {error}"
                ) from None
        compiled[name] = patterns
    deny, allow = compiled["deny"], compiled["allow"]
    if not deny and not allow:
        raise ValueError("the regex guard needs 'deny' or 'allow' patterns in [guards.options]")
    message = _string(options, "message", REFUSED)

    async def regex(context: Prompt | Window | Outcome) -> Refusal | None:
        text = text_of(context)
        for index, pattern in enumerate(deny, start=1):
            if pattern.search(text) is not None:
                return Refusal(message, reason=f"deny pattern {index} matched")
        if (
            allow
            and isinstance(context, Prompt | Window)
            and text
            and not any(pattern.search(text) is not None for pattern in allow)
        ):
            return Refusal(message, reason="no allow pattern matched")
        return None

    return regex


def webhook_guard(guard: GuardConfig, services: GuardServices) -> GuardCall:
    options = _options(guard, ("url", "headers", "message"))
    url = _string(options, "url")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"option 'url' must be an http:// or https:// URL, not {url!r}")
    headers = options.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ValueError("option 'headers' must be a table of strings")
    message = _string(options, "message", REFUSED)
    gate = trio.Semaphore(WEBHOOK_CONNECTIONS)
    made: list[httpx.AsyncClient] = []

    async def webhook(context: Prompt | Window | Outcome) -> Refusal | None:
        if not made:
            made.append(services.client(url, guard.timeout))
        async with gate:
            # Cancelled here (the client left, a refusal elsewhere, the timeout), httpx on
            # trio closes this connection: the service sees it go.
            response = await made[0].post(url, json=_facts(context), headers=headers)
        if not 200 <= response.status_code < 300:
            raise RuntimeError(f"the policy service answered {response.status_code}")
        if len(response.content) > MAX_ANSWER_BYTES:
            raise RuntimeError("the policy service's answer is too long")
        verdict = response.json()
        if not isinstance(verdict, dict) or not isinstance(verdict.get("allow"), bool):
            raise TypeError('the policy service\'s answer has no "allow": true or false')
        if verdict["allow"]:
            return None
        reason = verdict.get("reason")
        return Refusal(message, reason=reason if isinstance(reason, str) and reason else "denied")

    return webhook


def _facts(context: Prompt | Window | Outcome) -> dict[str, Any]:
    """What a policy service is sent: the stage's text, and whose request it is."""
    facts: dict[str, Any] = {
        "guard": context.guard,
        "request_id": context.request_id,
        "endpoint": context.endpoint,
        "model": context.model,
        "key": context.key,
    }
    if isinstance(context, Prompt):
        facts.update(stage=context.stage, text=context.text)
    elif isinstance(context, Window):
        facts.update(stage="output", text=context.text, index=context.index, final=context.final)
    else:
        facts.update(
            stage="after",
            status=context.status,
            outcome=context.outcome,
            input_tokens=context.input_tokens,
            output_tokens=context.output_tokens,
            refused_by=context.refused_by,
        )
    return facts


# Llama Guard's own answer starts with "safe" or "unsafe" on its first line.
DEFAULT_MODEL_PROMPT = (
    "Is the following text safe? Answer 'safe' or 'unsafe' on the first line.\n\n{text}"
)


def model_guard(guard: GuardConfig, services: GuardServices) -> GuardCall:
    options = _options(guard, ("model", "prompt", "refuse", "max_tokens", "message"))
    model = _string(options, "model")
    if services.config.model(model) is None:
        raise ValueError(f"option 'model' names {model!r}, which this server does not serve")
    template = _string(options, "prompt", DEFAULT_MODEL_PROMPT)
    if "{text}" not in template:
        raise ValueError("option 'prompt' must hold {text}, where the text to judge goes")
    try:
        refuse = re.compile(_string(options, "refuse", r"^\s*unsafe"), re.IGNORECASE)
    except re.error as error:
        raise ValueError(f"option 'refuse' is no regex: {error}") from None
    max_tokens = options.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("option 'max_tokens' must be a positive integer")
    message = _string(options, "message", REFUSED)

    async def judged_by_model(context: Prompt | Window | Outcome) -> Refusal | None:
        backend = services.backends.get(model)
        if backend is None:
            raise RuntimeError(f"the guard model {model!r} is not being served")
        body = {
            "model": model,
            "messages": [{"role": "user", "content": template.replace("{text}", text_of(context))}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": False,
        }
        request = parse_api_request(json.dumps(body).encode(), Endpoint.CHAT)
        sink = CollectSink()
        await backend.produce(request, f"{context.request_id}-{context.guard}", sink)
        if sink.status != 200:
            raise RuntimeError(f"the guard model answered {sink.status}")
        answer = json.loads(b"".join(sink.chunks))
        content = answer["choices"][0]["message"]["content"] or ""
        first = content.strip().split("\n", 1)[0]
        if refuse.search(first) is not None:
            return Refusal(message, reason=f"{model}: {first[:80]}")
        return None

    return judged_by_model


class CollectSink:
    """A :class:`~proxy.relay.body.Sink` that keeps a whole answer (a guard model's), bounded
    by MAX_ANSWER_BYTES."""

    def __init__(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []
        self._size = 0
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    @property
    def client_gone(self) -> bool:
        return False

    def set_phase(self, phase: Phase) -> None:
        pass

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        pass

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        self._started = True
        self.status = status

    def offer(self, chunk: bytes) -> bool:
        self._size += len(chunk)
        if self._size > MAX_ANSWER_BYTES:
            raise RuntimeError("the guard model's answer is too long")
        self.chunks.append(chunk)
        return True

    async def send(self, chunk: bytes) -> None:
        self.offer(chunk)


BUILTINS: dict[str, Callable[[GuardConfig, GuardServices], GuardCall]] = {
    "regex": regex_guard,
    "webhook": webhook_guard,
    "model": model_guard,
}
