"""The one request pipeline: every API request (chat, completions, Responses, Messages,
embeddings, pass-through), over every transport, goes through it, and every cross-cutting
contract is applied here and nowhere else.

A transport (HTTP, WebSocket) brings its own parsing of the wire and its own event shapes; the
one responder (``responder.py``) asks the pipeline, in order:

1. :meth:`RequestPipeline.begin`: the request id and its access record (the access line).
2. :meth:`RequestPipeline.authenticate`: the client's key, in any of its credential forms
   (401 otherwise).
3. :meth:`RequestPipeline.parse`: the body, under the size limit, with one set of errors.
4. :meth:`RequestPipeline.relay`: the :class:`~proxy.relay.RelayBody` that runs the request:
   the key's limits (requests per minute, concurrent streams, token budgets: the request held
   to its key's cap, metered, reserved on admission and settled at its end) admitted inside
   it, the backend's own admission, the stall limit, the relay's lifetime (one nursery),
   metrics, drain tracking (the tracker's active relays) and the access line at its close.
5. :meth:`RequestPipeline.refused` for a request refused before a relay existed: the same
   metric and the same access line, with the refusal's code as the outcome.
"""

from __future__ import annotations

import dataclasses
import math
import re
import uuid
import weakref
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

import trio

from proxy.api.auth import KeyRing, limited_producer
from proxy.api.guards import ServedGuards, outcome_of
from proxy.api.token_budget import Metered, metered_producer, metered_request
from proxy.backends.base import Backend
from proxy.config import Config, KeyConfig, LocalModel, UpstreamModel
from proxy.ops import tracing
from proxy.ops.logs import AccessRecord
from proxy.ops.metrics import Metrics
from proxy.protocol.api_request import parse_api_request
from proxy.protocol.errors import SERVER_ERROR, ApiError, bad_request, model_not_found
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.request_priority import (
    PRIORITY_HEADER,
    asked_priority,
    positive_seconds,
    request_band,
)
from proxy.protocol.rewrite import REMOVE, with_edits
from proxy.protocol.scheduling import Schedule
from proxy.protocol.shapes import error_shape
from proxy.protocol.token_usage import DEFAULT_RESERVED_OUTPUT, estimate_input_tokens
from proxy.relay.body import Producer, RelayBody, RelayTracker
from proxy.relay.guarded import Guard, guarded_producer
from proxy.server.call import HeaderLookup

if TYPE_CHECKING:
    # Imported only where [auth] is configured (served_config.py): PyJWT and cryptography
    # are not loaded otherwise.
    from proxy.api.identity import Identity

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestPipeline:
    """Shared by every request of one server process."""

    def __init__(
        self,
        config: Config,
        keys: KeyRing,
        metrics: Metrics,
        tracker: RelayTracker,
        backends: Mapping[str, Backend],
        local_models: Mapping[str, object],
        *,
        loading: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.keys = keys
        self.metrics = metrics
        self.tracker = tracker
        # Filled in at start-up (the backends start with the server).
        self.backends = backends
        self.local_models = local_models
        # Local models still loading, and their stage: requests for them get a 503 meanwhile.
        self.loading: Mapping[str, str] = loading if loading is not None else {}
        # The relays begun through this pipeline and not yet closed: a reload retires this
        # pipeline's backends once it is empty (api/served_config.py).
        self.relays: weakref.WeakSet[RelayBody] = weakref.WeakSet()
        # JWT issuers and forward auth ([auth]), set by the served config; None: static keys.
        self.identity: Identity | None = None
        # The [[guards]] (api/guards.py), set by the served config; None: none configured.
        self.guards: ServedGuards | None = None

    @staticmethod
    def request_id(presented: str | None) -> str:
        """The client's X-Request-ID when it is sane, else a fresh one."""
        if presented and _REQUEST_ID.match(presented):
            return presented
        return uuid.uuid4().hex

    def begin(
        self,
        method: str,
        path: str,
        client: str,
        presented_id: str | None,
        headers: HeaderLookup | None = None,
    ) -> AccessRecord:
        """The request's access record; with tracing on, its SERVER span too, continuing the
        trace of ``headers`` (the request's, or a WebSocket's handshake)."""
        access = AccessRecord(
            self.request_id(presented_id), method, path, client or "-", trio.current_time()
        )
        active = tracing.ACTIVE
        if active is not None and headers is not None:
            access.trace = active.begin(
                headers.get("traceparent"), headers.get("tracestate"), method, path
            )
        return access

    async def authenticate(
        self, headers: HeaderLookup, access: AccessRecord, method: str = "POST", path: str = ""
    ) -> KeyConfig | None:
        """The client's key, as :meth:`static_key` finds it, or with ``[auth]`` as its
        identity maps it (a JWT, the forward-auth service's answer: api/identity.py), which
        may also refuse with 403 (an identity mapped onto no key) or 503 (forward auth
        unanswered)."""
        identity = self.identity
        if identity is None:
            return self.static_key(headers, access)
        key = await identity.identify(headers, method, path)
        access.key = key.name
        return key

    def static_key(self, headers: HeaderLookup, access: AccessRecord) -> KeyConfig | None:
        """The client's static key (None when no keys are configured); a 401 ApiError
        otherwise.

        Every credential form is read here, for every transport: ``Authorization: Bearer``,
        else ``x-api-key`` (Anthropic's SDKs send the key so, with anthropic-version). Both are
        checked against the same ``[[keys]]``, and neither is forwarded upstream."""
        if not self.keys.enabled:
            return None
        authorization = headers.get("Authorization")
        if authorization is None:
            api_key = headers.get("x-api-key")
            if api_key is not None:
                authorization = f"Bearer {api_key}"
        key = self.keys.identify(authorization)
        access.key = key.name
        return key

    async def screen(
        self, request: CompletionRequest, access: AccessRecord, key: KeyConfig | None
    ) -> CompletionRequest:
        """The ``request`` stage's guards ([[guards]] stage = "request"), before the queue:
        the request as they edited it, or their refusal (an ApiError). Nothing to do, and
        nothing awaited, without guards."""
        guards = self.guards
        if guards is None:
            return request
        return await guards.request_stage(request, access, key, self.metrics)

    def parse(
        self,
        raw: bytes,
        endpoint: Endpoint,
        *,
        path: str = "",
        content_type: str = "application/json",
        headers: HeaderLookup | None = None,
        message: bool = False,
    ) -> CompletionRequest:
        """The request's body, validated (within ``max_body_bytes``); with ``headers``, its
        conversation key too. ``message``: a WebSocket's chat message."""
        request = parse_api_request(
            raw,
            endpoint,
            path=path,
            content_type=content_type,
            max_bytes=self.config.server.max_body_bytes,
            message=message,
        )
        if endpoint is Endpoint.PASSTHROUGH:
            request = self._route_passthrough(request)
        return request if headers is None else self.with_session(request, headers)

    def with_session(self, request: CompletionRequest, headers: HeaderLookup) -> CompletionRequest:
        """The request with its conversation key, when its model routes by a session header
        (``affinity_header``) and the client sent one."""
        model = self.config.model(request.model)
        if model is None or model.backend == "local" or not model.affinity_header:
            return request
        value = headers.get(model.affinity_header)
        return dataclasses.replace(request, session=value) if value else request

    def _route_passthrough(self, request: CompletionRequest) -> CompletionRequest:
        """A pass-through path goes to the model it names, which must list the path; one that
        names none goes to the one model that lists it, if only one does."""
        path = request.path
        serving = [
            m.name for m in self.config.models if m.backend == "upstream" and path in m.passthrough
        ]
        if not request.model:
            if len(serving) != 1:
                raise bad_request(
                    f"{path} is served by {len(serving)} models here: name one in 'model' "
                    "(the JSON body's, or a form field)",
                    param="model",
                )
            return dataclasses.replace(request, model=serving[0])
        if request.model not in serving:
            if request.model not in self.backends:
                raise model_not_found(request.model)
            raise ApiError(
                404,
                f"{path} is not a pass-through path of model '{request.model}'"
                + (f" (it is of: {', '.join(serving)})" if serving else ""),
                code="not_found",
            )
        return request

    def backend_for(self, model: str) -> Backend:
        backend = self.backends.get(model)
        if backend is None:
            if model in self.loading:
                raise ApiError(
                    503,
                    f"model '{model}' is loading ({self.loading[model]}); try again shortly",
                    type=SERVER_ERROR,
                    code="model_loading",
                    headers={"Retry-After": "5"},
                )
            raise model_not_found(model)
        return backend

    def schedule(
        self,
        request: CompletionRequest,
        access: AccessRecord,
        key: KeyConfig | None,
        headers: HeaderLookup | None,
    ) -> CompletionRequest:
        """``request`` with what the scheduler knows of it: its key, band, weight and input,
        and its deadlines (the SDK's read timeout for its first byte; the earlier of
        ``x-sluice-deadline`` and the key's ``max_request_seconds`` for its end); with the
        body's ``priority`` taken out, or set to the band where the upstream takes it.

        A malformed priority (the body's or the header's) is its 400 here, first: nothing of
        the request has been taken yet (its key's limits and the queue are entered inside the
        relay), so a refusal leaves nothing behind."""
        get = headers.get if headers is not None else (lambda name: None)
        body = request.body
        asked = body.get("priority") if isinstance(body, dict) else None
        band = request_band(
            0 if key is None else key.priority, asked_priority(get(PRIORITY_HEADER), asked)
        )
        now = access.started
        first_byte = positive_seconds(get("x-stainless-read-timeout")) or positive_seconds(
            get("x-stainless-timeout")
        )
        limits = [positive_seconds(get("x-sluice-deadline"))]
        if key is not None and key.max_request_seconds > 0:
            limits.append(key.max_request_seconds)
        done = min((limit for limit in limits if limit is not None), default=None)
        deadlines = [d for d in (first_byte, done) if d is not None]
        access.band = band
        access.deadline = min(deadlines) if deadlines else None
        schedule = Schedule(
            # Its account: the key, or one subject of a key mapped per subject.
            "" if key is None else key.account,
            band,
            1.0 if key is None else key.weight,
            estimate_input_tokens(body) if request.endpoint is not Endpoint.PASSTHROUGH else 0,
            first_byte_by=math.inf if first_byte is None else now + first_byte,
            read_timeout=math.inf if first_byte is None else first_byte,
            done_by=math.inf if done is None else now + done,
            report=access.waited,
            paused=access.paused,
        )
        request = dataclasses.replace(request, schedule=schedule)
        return self._with_priority(request, band, asked)

    def _with_priority(
        self, request: CompletionRequest, band: int, asked: object
    ) -> CompletionRequest:
        """The body's ``priority`` as the upstream is to see it: out, unless the model says its
        upstream takes it (vLLM with --scheduling-policy priority), then the band."""
        model = self.config.model(request.model)
        takes = isinstance(model, UpstreamModel) and model.upstream_priority
        if takes and asked != band:
            return with_edits(request, {"priority": band})
        if not takes and asked is not None:
            return with_edits(request, {"priority": REMOVE})
        return request

    def relay(
        self,
        request: CompletionRequest,
        access: AccessRecord,
        key: KeyConfig | None,
        headers: HeaderLookup | None = None,
    ) -> RelayBody:
        """The relay that runs ``request``: enter it (``async with``) and iterate it."""
        backend = self.backend_for(request.model)
        request = self.schedule(request, access, key, headers)
        local = request.model in self.local_models
        model = self.config.model(request.model)
        default_output = (
            model.default_max_tokens if isinstance(model, LocalModel) else DEFAULT_RESERVED_OUTPUT
        )
        # Every request that generates is metered: its tokens for its access line, its trace
        # and the scheduler's fair share (an upstream stream asked for its usage block); a
        # key with a token budget or cap is held to it too.
        request, metered = metered_request(
            request, key, upstream=not local, default_output=default_output
        )
        produce: Producer = partial(backend.produce, request, access.request_id)
        guards = self.guards
        if guards is not None:
            # The prompt and output stages, innermost: beside the backend, in its task's
            # nursery, so that a refusal cancels the upstream (and the meter still counts
            # what it made).
            plan = guards.plan(request, access, key, self.metrics)
            if plan is not None:
                produce = guarded_producer(
                    partial(backend.produce, request, access.request_id), plan
                )
        if key is not None and self.keys.limited(key):
            # Admitted inside the relay, so that its 429 is counted like any relayed status
            # and the concurrency it holds is released when the body closes.
            budgeted = metered if metered is not None and metered.key is not None else None
            produce = limited_producer(self.keys, key, produce, budgeted)
            if metered is not None and budgeted is None:
                produce = metered_producer(produce, metered)
        elif metered is not None:
            produce = metered_producer(produce, metered)
        trace = access.trace
        if trace is not None:
            trace.operation(
                request.endpoint.label,
                request.model,
                local=local,
                stream=request.stream,
                body=request.body,
            )
            produce = trace.run(produce)
        relay = self.config.relay
        schedule = request.schedule
        body = RelayBody(
            produce,
            deadlines=(schedule.first_byte_by, schedule.done_by),
            streaming=request.stream,
            channel_capacity=relay.channel_capacity,
            stall_timeout=relay.stall_timeout,
            tracker=self.tracker,
            description=access.request_id,
            model=request.model,
            backend="local" if local else "upstream",
            access=access,
            errors=error_shape(request.endpoint),
            endpoint=request.endpoint.label,
        )
        self.relays.add(body)
        # A weak reference: the callback must not keep its body alive (a cycle).
        body.close_callbacks.append(partial(_discard, self.relays, weakref.ref(body)))
        if metered is not None:
            body.close_callbacks.append(
                partial(_tokens_closed, metered, weakref.ref(body), access, self.metrics)
            )
        if guards is not None:
            hooks = guards.after(request.model, key)
            if hooks:
                # Last: the access record has its tokens by then.
                body.close_callbacks.append(
                    partial(_after_hooks, guards, hooks, request, weakref.ref(body), access)
                )
        return body

    def refused(
        self,
        access: AccessRecord | None,
        status: int,
        outcome: str,
        model: str,
        endpoint: Endpoint = Endpoint.CHAT,
    ) -> None:
        """An API request answered without a relay (bad input, 401, unknown model): the
        requests metric and the access line. ``model`` is a configured name or "-", and the
        key a configured key's name or "-": a client must not be able to grow the metrics by
        inventing names."""
        key = "-" if access is None else access.key_label
        self.metrics.requests.labels(model, str(status), endpoint.label, key).inc()
        if access is not None:
            self.finished(access, status, outcome, model)

    @staticmethod
    def finished(access: AccessRecord, status: int, outcome: str, model: str) -> None:
        """The access line of a response that is not a relay (its body writes its own)."""
        access.emit(status=status, model=model, outcome=outcome, ended=trio.current_time())


def _tokens_closed(
    metered: Metered, ref: weakref.ref[RelayBody], access: AccessRecord, metrics: Metrics
) -> None:
    body = ref()
    if body is not None:
        metered.closed(body, access, metrics)


def _after_hooks(
    guards: ServedGuards,
    hooks: tuple[Guard, ...],
    request: CompletionRequest,
    ref: weakref.ref[RelayBody],
    access: AccessRecord,
) -> None:
    """The relay closed: its ``after`` hooks, in the server's nursery (never this request's)."""
    body = ref()
    if body is None or guards.after_hooks is None:
        return
    guards.after_hooks.submit(
        hooks,
        outcome_of(
            access,
            request,
            status=body.final_status,
            outcome=body.outcome,
            ended=trio.current_time(),
            ttft=body.account.ttft,
        ),
    )


def _discard(relays: weakref.WeakSet[RelayBody], ref: weakref.ref[RelayBody]) -> None:
    body = ref()
    if body is not None:
        relays.discard(body)
