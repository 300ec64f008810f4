"""The ``[[guards]]`` of one served config: each table's ``use`` resolved (a built-in, or
imported and its signature checked: a start-up error naming the guard otherwise), which guards
apply to a request (``models``, ``keys``), and the ``request`` stage, run by the responder
before the queue. The ``prompt``, ``output`` and ``after`` stages run in the relay
(relay/guarded.py); the hook API users import is ``proxy.guards``.

Built at start-up and again at each reload, like the rest of the served config: a request
keeps the guards of the config it began on.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

import trio

from proxy.api.guard_builtins import BUILTINS, GuardServices
from proxy.config import Config, ConfigError, GuardConfig, KeyConfig
from proxy.guards import Outcome, Prompt, Refusal, Stage
from proxy.guards.window import prompt_text
from proxy.ops.logs import AccessRecord
from proxy.ops.metrics import Metrics
from proxy.protocol.api_request import parse_api_request
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.token_usage import generates
from proxy.relay.guarded import (
    AfterHooks,
    Guard,
    GuardCall,
    GuardObserver,
    RequestGuards,
    call_guard,
    refusal_error,
)


def _is_async(target: object) -> bool:
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an instance with an async __call__
    )


def _takes_one(target: Callable[..., Any]) -> bool:
    try:
        inspect.signature(target).bind(object())
    except (TypeError, ValueError):
        return False
    return True


def import_target(where: str, use: str) -> object:
    """What ``use`` ("package.module:function") names; a ConfigError naming ``where``."""
    module_name, _, attribute = use.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure of user code is a start-up error
        raise ConfigError(
            f"'use' in {where}: cannot import {module_name!r} ({type(error).__name__}: {error})"
        ) from None
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise ConfigError(f"'use' in {where}: {module_name!r} has no {attribute!r}") from None
    return target


def resolve(guard: GuardConfig, services: GuardServices) -> GuardCall:
    """The async callable of ``guard``: its built-in's, or what its ``use`` names (an async
    function of one argument, or a factory taking the options and returning one)."""
    where = f"[[guards]] {guard.name!r}"
    builtin = BUILTINS.get(guard.use)
    if builtin is not None:
        try:
            return builtin(guard, services)
        except (ValueError, TypeError, KeyError) as error:
            raise ConfigError(f"{where} (use = {guard.use!r}): {error}") from None
    target = import_target(where, guard.use)
    if _is_async(target):
        assert callable(target)
        if not _takes_one(target):
            raise ConfigError(
                f"'use' in {where}: {guard.use} must take one argument (the stage's context)"
            )
        return target
    if not callable(target) or not _takes_one(target):
        raise ConfigError(
            f"'use' in {where}: {guard.use} is neither an async function of one argument "
            "(the guard) nor a function of the options returning one (a factory)"
        )
    try:
        made = target(dict(guard.options))
    except Exception as error:  # noqa: BLE001 - the factory's refusal of its options
        raise ConfigError(
            f"{where}: its factory {guard.use} failed: {type(error).__name__}: {error}"
        ) from None
    if not (callable(made) and _is_async(made) and _takes_one(made)):
        raise ConfigError(
            f"{where}: its factory {guard.use} returned {made!r}, not an async function of "
            "one argument"
        )
    call: GuardCall = made
    return call


class ServedGuards:
    """One config's guards, built; what applies to each request."""

    def __init__(
        self,
        config: Config,
        services: GuardServices,
        after_hooks: AfterHooks | None = None,
    ) -> None:
        self.services = services
        self.after_hooks = after_hooks
        self.tables = config.guards
        self.guards = tuple(
            Guard(
                table.name,
                _stage(table.stage),
                resolve(table, services),
                table.timeout,
                table.on_error == "deny",
                table.options,
                table.window_tokens,
                table.overlap_tokens,
                table.hold_back_tokens,
                table.release == "after",
            )
            for table in config.guards
        )

    def select(self, stage: Stage, model: str, key: KeyConfig | None) -> tuple[Guard, ...]:
        """The guards of ``stage`` that apply to a request of ``model`` and ``key``, in order."""
        chosen = []
        for table, guard in zip(self.tables, self.guards, strict=True):
            if guard.stage != stage:
                continue
            if table.models and model not in table.models:
                continue
            if table.keys and (key is None or key.name not in table.keys):
                continue
            chosen.append(guard)
        return tuple(chosen)

    @staticmethod
    def context(
        request: CompletionRequest, access: AccessRecord, key: KeyConfig | None, stage: Stage
    ) -> Prompt:
        return Prompt(
            "",
            stage,
            access.request_id,
            request.endpoint.label,
            request.model,
            None if key is None else key.name,
            request.body,
            prompt_text(request.body),
        )

    async def request_stage(
        self,
        request: CompletionRequest,
        access: AccessRecord,
        key: KeyConfig | None,
        metrics: Metrics | None,
    ) -> CompletionRequest:
        """The ``request`` guards, in order: the request as they edited it, or the first
        refusal as an ApiError (the responder answers it in the endpoint's shape)."""
        guards = self.select("request", request.model, key)
        if not guards or request.endpoint is Endpoint.PASSTHROUGH:
            return request
        observer = GuardObserver(metrics, access)
        for guard in guards:
            prompt = dataclasses.replace(
                self.context(request, access, key, "request"),
                guard=guard.name,
                options=guard.options,
            )
            verdict = await call_guard(guard, prompt, observer)
            if isinstance(verdict, Refusal):
                observer.refused(guard, verdict)
                self.after_refusal(request, access, key, verdict)
                raise refusal_error(verdict)
            if isinstance(verdict, Mapping):
                request = edited(request, verdict, guard)
        return request

    def plan(
        self,
        request: CompletionRequest,
        access: AccessRecord,
        key: KeyConfig | None,
        metrics: Metrics | None,
    ) -> RequestGuards | None:
        """The ``prompt`` and ``output`` guards of ``request``; None when none applies."""
        if request.endpoint is Endpoint.PASSTHROUGH:
            return None
        prompt = self.select("prompt", request.model, key)
        output = self.select("output", request.model, key) if generates(request.endpoint) else ()
        if not prompt and not output:
            return None
        return RequestGuards(
            prompt,
            output,
            self.context(request, access, key, "prompt"),
            GuardObserver(metrics, access),
        )

    def after(self, model: str, key: KeyConfig | None) -> tuple[Guard, ...]:
        if self.after_hooks is None:
            return ()
        return self.select("after", model, key)

    def after_refusal(
        self,
        request: CompletionRequest,
        access: AccessRecord,
        key: KeyConfig | None,
        refusal: Refusal,
    ) -> None:
        """A request refused at the ``request`` stage still has its ``after`` hooks."""
        hooks = self.after(request.model, key)
        if hooks and self.after_hooks is not None:
            self.after_hooks.submit(
                hooks,
                outcome_of(
                    access,
                    request,
                    status=refusal.status,
                    outcome=refusal.code,
                    ended=trio.current_time(),
                    ttft=None,
                ),
            )

    async def aclose(self) -> None:
        await self.services.aclose()


def outcome_of(
    access: AccessRecord,
    request: CompletionRequest,
    *,
    status: int,
    outcome: str,
    ended: float,
    ttft: float | None,
) -> Outcome:
    tokens = access.tokens
    return Outcome(
        "",
        access.request_id,
        request.endpoint.label,
        request.model,
        access.key,
        status,
        outcome,
        None if tokens is None else tokens[0],
        None if tokens is None else tokens[1],
        None if tokens is None else tokens[2],
        None if tokens is None else tokens[3],
        access.guard,
        access.guard_reason,
        ended - access.started,
        ttft,
    )


def edited(request: CompletionRequest, body: Mapping[str, Any], guard: Guard) -> CompletionRequest:
    """``request`` with the body a request guard returned, validated as a client's would be
    (a 500 naming the guard when it is not valid: the guard's bug, not the client's)."""
    try:
        raw = json.dumps(body).encode()
        again = parse_api_request(
            raw, request.endpoint, path=request.path, content_type=request.content_type
        )
    except (TypeError, ValueError, ApiError) as error:
        detail = error.message if isinstance(error, ApiError) else str(error)
        raise ApiError(
            500,
            f"guard {guard.name!r} returned a body that is not a valid request: {detail}",
            type="server_error",
            code="guard_error",
        ) from None
    if again.model != request.model:
        raise ApiError(
            500,
            f"guard {guard.name!r} changed the request's model, which routing has decided",
            type="server_error",
            code="guard_error",
        )
    return dataclasses.replace(
        again,
        include_usage=request.include_usage,
        session=request.session,
        schedule=request.schedule,
    )


def _stage(name: str) -> Stage:
    for stage in ("request", "prompt", "output", "after"):
        if stage == name:
            return stage
    raise ConfigError(f"no guard stage {name!r}")  # pragma: no cover - config validated it


def check_guards(config: Config, env: Mapping[str, str]) -> None:
    """What serving checks of ``config``'s guards, without serving: each ``use`` resolved
    (the supervisor, before its workers start)."""
    if not config.guards:
        return
    services = GuardServices(config, env, {})
    for table in config.guards:
        resolve(table, services)
