"""Typed configuration: TOML file, then ``SLUICE_<SECTION>_<KEY>`` environment, then CLI flags.

Unknown keys are errors that name the key and where it came from: a typo in a timeout must not
silently leave the default in force.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

ENV_PREFIX = "SLUICE_"
# Environment variables under the prefix that are not config keys.
_ENV_NOT_KEYS = frozenset({"SLUICE_CONFIG"})


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says which key and why."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Largest request body accepted; larger gets 413 before any work is done.
    max_body_bytes: int = 4 * 1024 * 1024
    keep_alive_timeout: float = 5.0
    graceful_timeout: float = 10.0


@dataclass(frozen=True)
class RelayConfig:
    # Events buffered per request between the producer and the client's socket. This bounds
    # a request's memory; a slow reader blocks the producer instead of growing it.
    channel_capacity: int = 16
    # A client that has not taken an event for this long is cut off and its work cancelled.
    stall_timeout: float = 30.0
    max_event_bytes: int = 1024 * 1024
    # Largest non-streaming upstream body (and upstream error body) the relay will hold.
    max_response_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True)
class UpstreamConfig:
    """Defaults for every upstream model, and the settings of each replica's connection pool."""

    connect_timeout: float = 5.0
    first_token_timeout: float = 60.0
    idle_timeout: float = 30.0
    total_timeout: float = 600.0
    # Attempts on distinct replicas, made only before the first byte reaches the client.
    max_attempts: int = 2
    api_key_env: str = ""
    max_connections: int = 256
    max_keepalive_connections: int = 64
    keepalive_expiry: float = 30.0
    # SO_RCVBUF for upstream sockets; 0 keeps the OS default. A small value makes backpressure
    # reach the upstream server after fewer buffered bytes.
    socket_rcvbuf: int = 0


@dataclass(frozen=True)
class ModelConfig:
    name: str
    upstreams: tuple[str, ...]
    api_key_env: str = ""
    connect_timeout: float = 5.0
    first_token_timeout: float = 60.0
    idle_timeout: float = 30.0
    total_timeout: float = 600.0
    max_attempts: int = 2


@dataclass(frozen=True)
class FakeUpstreamConfig:
    """An in-process fake upstream, so that a demo needs no second process."""

    enabled: bool = False
    ttft: float = 0.3
    interval: float = 0.05
    tokens: int = 60


# The placeholder a model's `upstreams` uses for the in-process fake upstream.
FAKE_UPSTREAM_URL = "fake:"

_MODEL_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - {"name"}
_MODEL_DEFAULTED_KEYS = _MODEL_KEYS - {"upstreams"}


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    fake_upstream: FakeUpstreamConfig = field(default_factory=FakeUpstreamConfig)
    models: tuple[ModelConfig, ...] = ()
    source: str = "<defaults>"

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "relay": RelayConfig,
    "upstream": UpstreamConfig,
    "fake_upstream": FakeUpstreamConfig,
}

T = TypeVar("T")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, not {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, not {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, not {value!r}")
    if typing.get_origin(annotation) is tuple:
        if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
            return tuple(value)
        raise ConfigError(f"{where} must be an array of strings, not {value!r}")
    raise AssertionError(f"no coercion for {annotation!r}")  # pragma: no cover


def _from_env_text(text: str, annotation: Any, where: str) -> Any:
    """Environment values are strings: read them as the key's type."""
    if annotation is bool:
        lowered = text.strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"{where} must be true or false, not {text!r}")
    try:
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where} cannot be read as {annotation.__name__}: {text!r}") from None
    if typing.get_origin(annotation) is tuple:
        return tuple(item.strip() for item in text.split(",") if item.strip())
    return text


def _build(cls: type[T], table: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in table:
        if key not in known:
            raise ConfigError(
                f"unknown key '{key}' in {where}; known keys: {', '.join(sorted(known))}"
            )
    values = {
        key: _coerce(value, hints[key], f"'{key}' in {where}") for key, value in table.items()
    }
    return cls(**values)


def _check_positive(where: str, **values: float) -> None:
    for name, value in values.items():
        # Written so that NaN fails too; inf is no deadline at all, so it is refused as well.
        if not (0 < value < math.inf):
            raise ConfigError(f"'{name}' in {where} must be a finite number > 0, not {value!r}")


def _check_not_negative(where: str, **values: float) -> None:
    for name, value in values.items():
        if not (0 <= value < math.inf):
            raise ConfigError(f"'{name}' in {where} must be a finite number >= 0, not {value!r}")


def _validate(config: Config) -> None:
    server, relay, upstream = config.server, config.relay, config.upstream
    if not 0 <= server.port <= 65535:
        raise ConfigError(f"'port' in [server] must be 0..65535, not {server.port}")
    _check_positive(
        "[server]",
        max_body_bytes=server.max_body_bytes,
        keep_alive_timeout=server.keep_alive_timeout,
    )
    _check_not_negative("[server]", graceful_timeout=server.graceful_timeout)
    _check_positive(
        "[relay]",
        channel_capacity=relay.channel_capacity,
        stall_timeout=relay.stall_timeout,
        max_event_bytes=relay.max_event_bytes,
        max_response_bytes=relay.max_response_bytes,
    )
    _check_positive(
        "[upstream]",
        max_connections=upstream.max_connections,
        keepalive_expiry=upstream.keepalive_expiry,
    )
    _check_positive(
        "[upstream]",
        connect_timeout=upstream.connect_timeout,
        first_token_timeout=upstream.first_token_timeout,
        idle_timeout=upstream.idle_timeout,
        total_timeout=upstream.total_timeout,
        max_attempts=upstream.max_attempts,
    )
    _check_not_negative(
        "[upstream]",
        max_keepalive_connections=upstream.max_keepalive_connections,
        socket_rcvbuf=upstream.socket_rcvbuf,
    )
    fake = config.fake_upstream
    _check_not_negative(
        "[fake_upstream]", ttft=fake.ttft, interval=fake.interval, tokens=fake.tokens
    )
    for model in config.models:
        where = f"[models.{model.name}]"
        if not model.upstreams:
            raise ConfigError(f"{where} needs 'upstreams', a non-empty array of base URLs")
        for url in model.upstreams:
            if url == FAKE_UPSTREAM_URL:
                if not config.fake_upstream.enabled:
                    raise ConfigError(
                        f"{where} uses '{FAKE_UPSTREAM_URL}' but [fake_upstream] is not enabled"
                    )
                continue
            parts = urlsplit(url)
            if parts.scheme not in {"http", "https"} or not parts.netloc:
                raise ConfigError(f"{where} upstream {url!r} is not an http(s):// base URL")
        _check_positive(
            where,
            connect_timeout=model.connect_timeout,
            first_token_timeout=model.first_token_timeout,
            idle_timeout=model.idle_timeout,
            total_timeout=model.total_timeout,
            max_attempts=model.max_attempts,
        )


def _build_models(
    models_table: Any, upstream: UpstreamConfig, source: str
) -> tuple[ModelConfig, ...]:
    if not isinstance(models_table, dict):
        raise ConfigError(f"[models] in {source} must be a table of model tables")
    hints = typing.get_type_hints(ModelConfig)
    models = []
    for name, table in models_table.items():
        where = f"[models.{name}] ({source})"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        values: dict[str, Any] = {key: getattr(upstream, key) for key in _MODEL_DEFAULTED_KEYS}
        for key, value in table.items():
            if key not in _MODEL_KEYS:
                raise ConfigError(
                    f"unknown key '{key}' in {where}; known keys: {', '.join(sorted(_MODEL_KEYS))}"
                )
            values[key] = _coerce(value, hints[key], f"'{key}' in {where}")
        if "upstreams" not in values:
            raise ConfigError(f"{where} needs 'upstreams', a non-empty array of base URLs")
        values["upstreams"] = tuple(url.rstrip("/") for url in values["upstreams"])
        models.append(ModelConfig(name=name, **values))
    return tuple(models)


def config_from_mapping(
    data: Mapping[str, Any], source: str = "<mapping>", env: Mapping[str, str] | None = None
) -> Config:
    """Build a :class:`Config` from parsed TOML, then apply ``SLUICE_*`` environment overrides."""
    for key in data:
        if key not in _SECTIONS and key != "models":
            known = ", ".join(sorted([*_SECTIONS, "models"]))
            raise ConfigError(f"unknown section or key '{key}' in {source}; known: {known}")
    sections: dict[str, dict[str, Any]] = {}
    for name in _SECTIONS:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] in {source} must be a table")
        sections[name] = dict(table)
    for name, cls in _SECTIONS.items():
        _build(cls, sections[name], f"[{name}] ({source})")  # key errors name the file
    _apply_env(sections, os.environ if env is None else env)
    built = {name: _build(cls, sections[name], f"[{name}]") for name, cls in _SECTIONS.items()}
    models = _build_models(data.get("models", {}), built["upstream"], source)
    config = Config(models=models, source=source, **built)
    _validate(config)
    return config


def _apply_env(sections: dict[str, dict[str, Any]], env: Mapping[str, str]) -> None:
    # Longest section names first, so SLUICE_FAKE_UPSTREAM_X is not read as [fake] upstream_x.
    names = sorted(_SECTIONS, key=len, reverse=True)
    for variable, text in env.items():
        if not variable.startswith(ENV_PREFIX) or variable in _ENV_NOT_KEYS:
            continue
        rest = variable[len(ENV_PREFIX) :].lower()
        section = next((name for name in names if rest.startswith(name + "_")), None)
        if section is None:
            raise ConfigError(
                f"environment variable {variable} names no config section; expected "
                f"{ENV_PREFIX}<{'|'.join(n.upper() for n in _SECTIONS)}>_<KEY>"
            )
        key = rest[len(section) + 1 :]
        cls = _SECTIONS[section]
        hints = typing.get_type_hints(cls)
        if key not in hints:
            known = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
            raise ConfigError(
                f"environment variable {variable} names unknown key '{key}' in [{section}]; "
                f"known keys: {known}"
            )
        sections[section][key] = _from_env_text(text, hints[key], f"{variable}")


def load_config(
    path: str | Path | None,
    *,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
    port: int | None = None,
) -> Config:
    """Read a TOML file (or defaults when None), apply env, then the CLI flags that were given."""
    if path is None:
        data: dict[str, Any] = {}
        source = "<defaults>"
    else:
        source = str(path)
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {source}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{source} is not valid TOML: {error}") from None
    config = config_from_mapping(data, source, env)
    server_overrides: dict[str, Any] = {}
    if host is not None:
        server_overrides["host"] = host
    if port is not None:
        server_overrides["port"] = port
    if server_overrides:
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, **server_overrides)
        )
        _validate(config)
    return config
