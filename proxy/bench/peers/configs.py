"""The configs the peers read, written from templates kept here (pure functions: a run's
addresses in, the file's text out), and the argv of the peers configured by flags alone.
Each is the system's fair setting for streaming: nothing buffers a stream, no timeout cuts a
long one, one worker process (as the Sluice it is compared with)."""

from __future__ import annotations

import json
from typing import Final
from urllib.parse import urlsplit

# The prefix of the typed configs' names in Envoy's bootstrap.
_API: Final = "type.googleapis.com/envoy.extensions"


def upstream_address(fake_url: str) -> tuple[str, int]:
    """(host, port) of ``http://host:port``."""
    parts = urlsplit(fake_url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"the fake's URL needs a host and a port: {fake_url!r}")
    return parts.hostname, parts.port


def envoy_config(listen: tuple[str, int], fake_url: str) -> str:
    """Envoy's bootstrap: one listener, every path to the fake over HTTP/1.1.

    Route timeout 0 (Envoy's default is 15 s, which would cut a long stream) and no stream
    idle timeout (a long first token is no idle stream); WebSocket upgrades relayed; its
    cluster's circuit breakers opened (their defaults cap a thousand concurrent streams)."""
    host, port = upstream_address(fake_url)
    return f"""\
# Written by proxy.bench.peers for one run.
static_resources:
  listeners:
  - name: ingress
    address:
      socket_address: {{ address: {json.dumps(listen[0])}, port_value: {listen[1]} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {_API}.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          codec_type: AUTO
          stream_idle_timeout: 0s
          request_timeout: 0s
          upgrade_configs:
          - upgrade_type: websocket
          route_config:
            virtual_hosts:
            - name: fake
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: fake, timeout: 0s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": {_API}.filters.http.router.v3.Router
  clusters:
  - name: fake
    type: STATIC
    connect_timeout: 5s
    # Envoy's default limits (1024 connections, pending and active requests) would refuse
    # streams past a thousand with 503s, which no other system here does.
    circuit_breakers:
      thresholds:
      - max_connections: 1000000
        max_pending_requests: 1000000
        max_requests: 1000000
    load_assignment:
      cluster_name: fake
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {json.dumps(host)}, port_value: {port} }}
"""


def envoy_argv(envoy: str, config: str) -> list[str]:
    # No hot restart: two Envoys (side by side in the load bench) would share its memory.
    return [envoy, "-c", config, "--concurrency", "1", "--disable-hot-restart", "-l", "warn"]


def nginx_config(listen: tuple[str, int], fake_url: str, workdir: str, user: str | None) -> str:
    """nginx's config: in the foreground (``daemon off``: the bench owns the process), one
    worker, its pid and temp files in ``workdir``, its errors on stderr (the peer's log); no
    buffering of the answer or the request, keep-alive to the fake (HTTP/1.1 and an empty
    Connection header, unless the client asks to upgrade to a WebSocket). ``user``: who the
    worker runs as where nginx starts as root (nginx's default there would be nobody), None
    where it does not."""
    host, port = upstream_address(fake_url)
    user_line = f"user {user};\n" if user else ""
    temp = f"{workdir}/nginx-temp"
    return f"""\
# Written by proxy.bench.peers for one run.
{user_line}daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log stderr warn;
events {{
    worker_connections 16384;
}}
http {{
    access_log off;
    client_body_temp_path {temp}/client_body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        "" "";
    }}
    upstream fake {{
        server {host}:{port};
        keepalive 1024;
    }}
    server {{
        listen {listen[0]}:{listen[1]};
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
        }}
    }}
}}
"""


def nginx_argv(nginx: str, workdir: str, config: str) -> list[str]:
    # -e: the log nginx opens before it reads its config (else /var/log/nginx): its stderr,
    # which is the peer's log, as its error_log is.
    return [nginx, "-p", workdir, "-e", "stderr", "-c", config]


def router_argv(
    router: str | list[str], listen: tuple[str, int], fake_url: str, log_level: str
) -> list[str]:
    """vllm-router's and sglang-router's flags (their launchers share them; ``router`` is the
    command, one word or several): round-robin over the one fake worker. Retries and the
    circuit breaker off: a request the fake is told to fail, or to hold, is the client's to
    see, not the router's to replay. ``log_level``: each spells "warning" its own way."""
    command = [router] if isinstance(router, str) else router
    return [
        *command,
        "--host",
        listen[0],
        "--port",
        str(listen[1]),
        "--worker-urls",
        fake_url,
        "--policy",
        "round_robin",
        "--disable-retries",
        "--disable-circuit-breaker",
        "--log-level",
        log_level,
    ]


def litellm_config(fake_url: str, model: str) -> str:
    """LiteLLM's proxy config: ``model`` sent, as an OpenAI-compatible model, to the fake."""
    return (
        "# Written by proxy.bench.peers for one run.\n"
        "model_list:\n"
        f"  - model_name: {json.dumps(model)}\n"
        "    litellm_params:\n"
        f"      model: {json.dumps('openai/' + model)}\n"
        f"      api_base: {json.dumps(fake_url + '/v1')}\n"
        "      api_key: unused-by-the-fake\n"
    )


def litellm_argv(litellm: str, listen: tuple[str, int], config: str) -> list[str]:
    argv = [litellm, "--config", config, "--host", listen[0], "--port", str(listen[1])]
    return [*argv, "--num_workers", "1"]


def portkey_headers(fake_url: str) -> tuple[tuple[str, str], ...]:
    """What each request to Portkey's gateway carries: its OpenAI provider and the fake as the
    custom host (the OpenAI-compatible route to a self-hosted model). The client's own
    Authorization, if any, is forwarded as it is (the fake takes any, or none)."""
    return (("x-portkey-provider", "openai"), ("x-portkey-custom-host", fake_url + "/v1"))
