"""What a reload (SIGHUP) serves: the config file read again, as at start-up, and what of it
can be applied to a running process.

Applied: the keys and their limits, the [[guards]] (rebuilt: each use imported again), the
upstream models and their upstreams, balance, queue
and timeout settings, [upstream], [relay], [limits] and [auth] (an unchanged issuer keeps its
key set). Not without a restart, and left as
they were: [server] (host, port and workers among it: the sockets, the processes and the HTTP
server are made once), [fake_upstream] and [tracing] (started beside the app, once per
process), a local model's table (its weights are loaded once; its batch engine runs with
them), and a pass-through path no model had (its route is registered at start-up). Each is
named in the log line when the file changed it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.config import (
    Config,
    ConfigError,
    LocalModel,
    ModelConfig,
    check_public_bind,
    load_config,
)

# What sluice_config_reloads_total counts, by its outcome label.
RELOAD_OUTCOMES = ("applied", "invalid", "restart_needed")
# The sections read once per process: a change waits for a restart.
RESTART_ONLY_SECTIONS = ("server", "fake_upstream", "tracing")


@dataclass(frozen=True)
class ReloadPlan:
    # What the process serves from now on: the file's, less what needs a restart.
    config: Config
    # The file's changes left for a restart ("server.port", "models.tiny.path"...).
    restart_needed: tuple[str, ...]
    # What the reload applies, for its log line: "keys added: bob", "models changed: m
    # (timeout)"... Empty when the file changed nothing that applies.
    applied_changes: tuple[str, ...] = ()

    @property
    def outcome(self) -> str:
        return "restart_needed" if self.restart_needed else "applied"


class ConfigReloader:
    """Reads the config file again, with the environment it was first read with. The command
    line's host, port and workers (the only flags that override the file) are restart-only, so
    they stay as they are; what the file said of them at start is kept to tell a change."""

    def __init__(self, running: Config, env: Mapping[str, str]) -> None:
        self.path = None if running.source == "<defaults>" else running.source
        self.env = env
        try:
            # Read at start-up: a command line's --port is not a change of the file's port.
            self.file_server = load_config(self.path, env=env).server
        except (ConfigError, OSError):
            # Not a file (a config built in code), or already changed: the running one.
            self.file_server = running.server

    def read(self, running: Config) -> ReloadPlan:
        """The plan for the file as it is now; a :class:`ConfigError` when it cannot be
        served (it does not parse, does not validate, or names nothing to serve)."""
        try:
            fresh = load_config(self.path, env=self.env)
        except OSError as error:
            raise ConfigError(f"cannot read {self.path}: {error.strerror or error}") from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"{self.path} is not UTF-8 text: {error.reason}") from None
        if not fresh.models:
            raise ConfigError(f"{fresh.source} configures no model, so there is nothing to serve")
        plan = plan_reload(running, self.file_server, fresh)
        # Keys removed from a public address: refused as at start-up.
        check_public_bind(plan.config)
        return plan


def plan_reload(running: Config, file_server: object, fresh: Config) -> ReloadPlan:
    """``fresh`` as far as it applies to a process serving ``running`` (whose file said
    ``file_server`` of [server] at start): a pure step, no I/O."""
    restart: list[str] = []
    for section in RESTART_ONLY_SECTIONS:
        before = file_server if section == "server" else getattr(running, section)
        restart += _changed(section, before, getattr(fresh, section))
    running_local = {m.name: m for m in running.models if isinstance(m, LocalModel)}
    fresh_local = {m.name: m for m in fresh.models if isinstance(m, LocalModel)}
    for name in sorted(running_local.keys() | fresh_local.keys()):
        before_model, after_model = running_local.get(name), fresh_local.get(name)
        if before_model is None:
            restart.append(f"models.{name} (a new local model)")
        elif after_model is None:
            restart.append(f"models.{name} (a local model, still served)")
        else:
            restart += _changed(f"models.{name}", before_model, after_model)
    routed = {path for m in running.models if m.backend == "upstream" for path in m.passthrough}
    for model in fresh.models:
        if model.backend == "upstream" and model.name not in running_local:
            new_paths = sorted(set(model.passthrough) - routed)
            if new_paths:
                restart.append(f"models.{model.name}.passthrough ({', '.join(new_paths)})")
    applied = dataclasses.replace(
        fresh,
        server=running.server,
        fake_upstream=running.fake_upstream,
        tracing=running.tracing,
        models=_models(running_local, fresh.models),
        source=running.source,
    )
    return ReloadPlan(applied, tuple(restart), tuple(describe_changes(running, applied)))


# The sections a reload applies whole, beside the keys and the models.
APPLIED_SECTIONS = ("upstream", "relay", "limits", "scheduling", "auth")


def describe_changes(running: Config, applied: Config) -> list[str]:
    """What serving ``applied`` instead of ``running`` changes, as an operator reads it: keys
    and models added, removed, or changed (naming the fields, never a key's hash), and the
    fields of the sections applied whole."""
    lines: list[str] = []
    before_keys = {key.name: key for key in running.keys}
    after_keys = {key.name: key for key in applied.keys}
    lines += _named_changes("keys", before_keys, after_keys)
    before_models = {model.name: model for model in running.models}
    after_models = {model.name: model for model in applied.models}
    lines += _named_changes("models", before_models, after_models)
    before_guards = {guard.name: guard for guard in running.guards}
    after_guards = {guard.name: guard for guard in applied.guards}
    lines += _named_changes("guards", before_guards, after_guards)
    if list(before_guards) != list(after_guards) and set(before_guards) == set(after_guards):
        lines.append("guards reordered")
    for section in APPLIED_SECTIONS:
        fields = _changed_fields(getattr(running, section), getattr(applied, section))
        if fields:
            lines.append(f"{section} changed: {', '.join(fields)}")
    return lines


def _named_changes(
    kind: str, before: Mapping[str, object], after: Mapping[str, object]
) -> list[str]:
    lines = []
    added = [name for name in after if name not in before]
    removed = [name for name in before if name not in after]
    changed = []
    for name in after:
        if name in before and before[name] != after[name]:
            old, new = before[name], after[name]
            if type(old) is not type(new):
                changed.append(f"{name} (backend)")
                continue
            fields = _changed_fields(old, new)
            changed.append(f"{name} ({', '.join(fields)})")
    if added:
        lines.append(f"{kind} added: {', '.join(added)}")
    if removed:
        lines.append(f"{kind} removed: {', '.join(removed)}")
    if changed:
        lines.append(f"{kind} changed: {', '.join(changed)}")
    return lines


def _models(
    running_local: Mapping[str, LocalModel], fresh: tuple[ModelConfig, ...]
) -> tuple[ModelConfig, ...]:
    """The fresh upstream models, and the local models as they run, in the file's order (a
    local model the file no longer names last)."""
    models: list[ModelConfig] = []
    for model in fresh:
        if model.name in running_local:
            models.append(running_local[model.name])
        elif model.backend == "upstream":
            models.append(model)
    named = {model.name for model in fresh}
    models += [model for name, model in running_local.items() if name not in named]
    return tuple(models)


def _changed(where: str, before: object, after: object) -> list[str]:
    return [f"{where}.{name}" for name in _changed_fields(before, after)]


def _changed_fields(before: object, after: object) -> list[str]:
    assert dataclasses.is_dataclass(before) and not isinstance(before, type)
    return [
        field.name
        for field in dataclasses.fields(before)
        if getattr(before, field.name) != getattr(after, field.name)
    ]
