"""`make test-vllm` / `make test-llamacpp`: start a real OpenAI-compatible server on SmolLM2,
run the tests marked for it through Sluice, stop it. Prints what the tests print (the abort
timing). Further arguments go to pytest (``-k trace`` runs only the tracing tests).

    python -m tests.integration.run_real_upstream vllm PYTHON MODEL_DIR [PYTEST_ARGS...]
        (vLLM's CPU build)
    python -m tests.integration.run_real_upstream llamacpp PYTHON GGUF_FILE [PYTEST_ARGS...]
        (llama-cpp-python's server)

vLLM exports its spans to an OTLP receiver in this process (vLLM needs the endpoint when it
starts, before any test), and the tests run in this process too, so that they read the spans
vLLM sent there: the fixture ``vllm_traces`` is that receiver.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from proxy.testing.otlp_receiver import Receiver, otlp_receiver

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
    kind: str, python: str, model: str, port: int, traces_endpoint: str = ""
) -> list[str]:
    if kind == "vllm":
        return [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-log-requests", "--dtype", VLLM_DTYPE, "--max-model-len", "2048",
            *(["--otlp-traces-endpoint", traces_endpoint] if traces_endpoint else []),
        ]  # fmt: skip
    return [
        python, "-m", "llama_cpp.server", "--model", model, "--model_alias", "smollm2",
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
    ]  # fmt: skip


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
    log_path = Path(f"{kind}-server.log").resolve()
    traces_endpoint = receiver.url + "/v1/traces" if receiver else ""
    command = server_command(kind, python, model, port, traces_endpoint)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if receiver:
        env.update(VLLM_TRACING_ENV)
    url = f"http://127.0.0.1:{port}"
    ready_path = "/health" if kind == "vllm" else "/v1/models"
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            started = time.monotonic()
            while True:
                if server.poll() is not None:
                    print(log_path.read_text(errors="replace")[-4000:])
                    print(f"{kind} exited with {server.returncode} during start-up")
                    return 1
                try:
                    with urllib.request.urlopen(url + ready_path, timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - started > START_DEADLINE:
                    print(f"{kind} did not become healthy in time")
                    return 1
                time.sleep(2)
            print(f"{kind} up on {url} after {time.monotonic() - started:.0f}s; log: {log_path}")
            prefix = "SLUICE_VLLM" if kind == "vllm" else "SLUICE_LLAMACPP"
            # The test modules read these when pytest imports them, in this process.
            os.environ.update({f"{prefix}_URL": url, f"{prefix}_LOG": str(log_path)})
            plugins = [UpstreamTraces(receiver)] if receiver else []
            arguments = ["-m", kind, "-s", "-q", f"tests/integration/test_{kind}.py"]
            return int(pytest.main([*arguments, *pytest_args], plugins=plugins))
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
