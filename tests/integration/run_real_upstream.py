"""`make test-vllm` / `make test-llamacpp`: start a real OpenAI-compatible server on SmolLM2,
run the tests marked for it through Sluice, stop it: the server and every process it starts
(tests/integration/server_tree.py), before the session's check that no test left a process
running, and with this runner however it ends. Prints what the tests print (the abort
timing). Further arguments go to pytest (``-k trace`` runs only the tracing tests).

    python -m tests.integration.run_real_upstream vllm PYTHON MODEL_DIR [PYTEST_ARGS...]
        (vLLM's CPU build)
    python -m tests.integration.run_real_upstream llamacpp PYTHON GGUF_FILE [PYTEST_ARGS...]
        (llama-cpp-python's server)

vLLM exports its spans to an OTLP receiver in this process (vLLM needs the endpoint when it
starts, before any test), and the tests run in this process too, so that they read the spans
vLLM sent there: the fixture ``vllm_traces`` is that receiver.

For ``cache_aware`` (tests/integration/test_vllm_kv_events.py) vLLM runs as two replicas, both
with prefix caching and KV events on ZeroMQ (``--kv-events-config``; the publisher binds
``tcp://*:PORT``, as vLLM binds only an endpoint with a wildcard and connects to any other, its
replay socket 127.0.0.1), started together: the first is also the one the other vLLM tests use
(``SLUICE_VLLM_URL``), and both are named in ``SLUICE_VLLM_KV_URLS`` and their publishers in
``SLUICE_VLLM_KV_EVENTS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.testing.otlp_receiver import Receiver, otlp_receiver
from tests.integration.server_tree import GRACE, ServerTree

START_DEADLINE = 900  # vLLM's CPU start-up (compilation, warm-up) takes minutes
# vLLM serves the converted SmolLM2 in float32, the dtype Sluice's local backend computes in and
# inference.convert writes: in bfloat16 the 135M model's logits move enough that vLLM's greedy
# answer changes ("L'Étoile, la Marseillaise, ..." instead of "The capital of France is Paris.").
VLLM_DTYPE = "float32"
# vLLM's exporter speaks gRPC unless told otherwise; the receiver speaks OTLP/HTTP. Its batch
# processor exports every 5 s by default: every 0.5 s, the tests wait less for its spans.
VLLM_TRACING_ENV = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    "OTEL_SERVICE_NAME": "vllm",
    "OTEL_BSP_SCHEDULE_DELAY": "500",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(
    kind: str,
    python: str,
    model: str,
    port: int,
    traces_endpoint: str = "",
    kv_events: tuple[int, int] | None = None,
) -> list[str]:
    """The server's command line; for vLLM with ``kv_events`` (its publisher's port and its
    replay port), prefix caching and KV events on ZeroMQ."""
    if kind == "vllm":
        return [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-log-requests", "--dtype", VLLM_DTYPE, "--max-model-len", "2048",
            *(["--otlp-traces-endpoint", traces_endpoint] if traces_endpoint else []),
            *(kv_events_args(*kv_events) if kv_events else []),
        ]  # fmt: skip
    return [
        python, "-m", "llama_cpp.server", "--model", model, "--model_alias", "smollm2",
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
    ]  # fmt: skip


def kv_events_args(port: int, replay_port: int) -> list[str]:
    """vLLM's flags for prefix caching and KV events published on ``port`` (every interface:
    vLLM binds only a wildcard endpoint), replayed on 127.0.0.1:``replay_port``."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    return ["--enable-prefix-caching", "--kv-events-config", json.dumps(config)]


def model_dir_problem(model: Path) -> str | None:
    """Why ``model`` is not a conversion vLLM can serve in VLLM_DTYPE, or None."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"{model} is not a converted model ({error}): python -m inference.convert {model}"
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype != VLLM_DTYPE:
        return (
            f"{model} holds {dtype} weights; vLLM is tested on {VLLM_DTYPE}: "
            f"python -m inference.convert {model} --if-stale"
        )
    return None


class UpstreamTraces:
    """The pytest plugin that hands the tests the receiver vLLM exports to."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    @pytest.fixture
    def vllm_traces(self) -> Receiver:
        return self.receiver


def main(argv: list[str]) -> int:
    kind, python, model, *pytest_args = argv
    if kind not in {"vllm", "llamacpp"}:
        print(f"unknown server kind {kind!r}: vllm or llamacpp")
        return 2
    if kind == "vllm" and (problem := model_dir_problem(Path(model))):
        print(problem)
        return 1
    if kind != "vllm":
        return serve_and_test(kind, python, model, None, pytest_args)
    with otlp_receiver() as receiver:
        return serve_and_test(kind, python, model, receiver, pytest_args)


def serve_and_test(
    kind: str, python: str, model: str, receiver: Receiver | None, pytest_args: list[str]
) -> int:
    port = free_port()
    traces_endpoint = receiver.url + "/v1/traces" if receiver else ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if receiver:
        env.update(VLLM_TRACING_ENV)
    url = f"http://127.0.0.1:{port}"
    prefix = "SLUICE_VLLM" if kind == "vllm" else "SLUICE_LLAMACPP"
    tests = [f"tests/integration/test_{kind}.py"]
    kv_events: tuple[int, int] | None = None
    beside: list[Beside] = []
    extra_env: dict[str, str] = {}
    if kind == "vllm":
        # Two replicas with KV events, for cache_aware: this one, and a second beside it.
        kv_events = (free_port(), free_port())
        second_port, second_events = free_port(), (free_port(), free_port())
        second_url = f"http://127.0.0.1:{second_port}"
        beside.append(
            Beside(
                "vllm (second replica)",
                server_command(kind, python, model, second_port, kv_events=second_events),
                Path("vllm-server-2.log").resolve(),
                second_url,
            )
        )
        extra_env = {
            "SLUICE_VLLM_KV_URLS": f"{url},{second_url}",
            "SLUICE_VLLM_KV_EVENTS": ",".join(
                f"tcp://127.0.0.1:{events}" for events, _ in (kv_events, second_events)
            ),
        }
        tests.append("tests/integration/test_vllm_kv_events.py")
    return run_with_server(
        kind,
        server_command(kind, python, model, port, traces_endpoint, kv_events),
        log_path=Path(f"{kind}-server.log").resolve(),
        env=env,
        url=url,
        ready_path="/health" if kind == "vllm" else "/v1/models",
        env_prefix=prefix,
        pytest_args=["-m", kind, "-s", "-q", *tests, *pytest_args],
        plugins=[UpstreamTraces(receiver)] if receiver else [],
        beside=beside,
        extra_env=extra_env,
    )


@dataclass(frozen=True)
class Beside:
    """Another server started with the first (its name, command line, log and URL), ready
    before the tests start and stopped as the first is."""

    name: str
    command: list[str]
    log_path: Path
    url: str


class StopsServer:
    """The pytest plugin that ends the server's tree as the session finishes, before the
    session's check that no test left a process running (tests/conftest.py, ``trylast``): the
    server is this runner's, not a test's, and the check must not find it, nor let it hide
    what a test did leave."""

    def __init__(self, name: str, tree: ServerTree) -> None:
        self.name = name
        self.tree = tree

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self) -> None:
        stop_tree(self.name, self.tree)


def stop_tree(name: str, tree: ServerTree) -> None:
    """Stops the tree (a no-op once it has ended) and says how long that took."""
    if tree.poll() is not None:
        return
    started = time.monotonic()
    forced = tree.stop()
    print(f"\n{name} stopped in {time.monotonic() - started:.1f}s")
    if forced:
        print(f"{name}'s keeper did not end its tree; killed: {forced}")


def run_with_server(
    name: str,
    command: list[str],
    *,
    log_path: Path,
    env: dict[str, str],
    url: str,
    ready_path: str,
    env_prefix: str,
    pytest_args: list[str],
    plugins: list[object],
    grace: float = GRACE,
    beside: Sequence[Beside] = (),
    extra_env: dict[str, str] | None = None,
) -> int:
    """Starts ``command`` (a server that will serve ``url``) as a :class:`ServerTree`, and each
    server ``beside`` it likewise, waits until ``ready_path`` answers 200 on every one, runs
    pytest in this process with ``{env_prefix}_URL`` and ``{env_prefix}_LOG`` (``log_path``,
    the first server's output) and ``extra_env`` set, and ends every tree before the session's
    leak check."""
    servers = [Beside(name, command, log_path, url), *beside]
    trees: list[tuple[Beside, ServerTree]] = []
    with contextlib.ExitStack() as logs:
        try:
            for server in servers:
                log = logs.enter_context(server.log_path.open("wb"))
                trees.append((server, ServerTree(server.command, log=log, env=env, grace=grace)))
            started = time.monotonic()
            waiting = list(trees)
            while waiting:
                for server, tree in list(waiting):
                    if tree.poll() is not None:
                        print(server.log_path.read_text(errors="replace")[-4000:])
                        print(f"{server.name} exited with {tree.poll()} during start-up")
                        return 1
                    try:
                        with urllib.request.urlopen(server.url + ready_path, timeout=2) as answer:
                            if answer.status == 200:
                                waiting.remove((server, tree))
                                print(
                                    f"{server.name} up on {server.url} after "
                                    f"{time.monotonic() - started:.0f}s; log: {server.log_path}"
                                )
                    except OSError:
                        pass
                if not waiting:
                    break
                if time.monotonic() - started > START_DEADLINE:
                    print(f"{', '.join(s.name for s, _ in waiting)} did not become healthy in time")
                    return 1
                time.sleep(2)
            # The test modules read these when pytest imports them, in this process.
            os.environ.update({f"{env_prefix}_URL": url, f"{env_prefix}_LOG": str(log_path)})
            os.environ.update(extra_env or {})
            stops = [StopsServer(server.name, tree) for server, tree in trees]
            return int(pytest.main(pytest_args, plugins=[*plugins, *stops]))
        finally:
            # Where the session never finished (start-up failed, pytest could not start).
            for server, tree in trees:
                stop_tree(server.name, tree)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
