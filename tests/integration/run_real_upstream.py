"""`make test-vllm` / `make test-llamacpp`: start a real OpenAI-compatible server on SmolLM2,
run the tests marked for it through Sluice, stop it. Prints what the tests print (the abort
timing).

    python -m tests.integration.run_real_upstream vllm PYTHON MODEL_DIR
        (vLLM's CPU build)
    python -m tests.integration.run_real_upstream llamacpp PYTHON GGUF_FILE
        (llama-cpp-python's server)
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

START_DEADLINE = 900  # vLLM's CPU start-up (compilation, warm-up) takes minutes
# vLLM serves the converted SmolLM2 in float32, the dtype Sluice's local backend computes in and
# inference.convert writes: in bfloat16 the 135M model's greedy answer changes (issue 21; "L'Étoile,
# la Marseillaise, ..." instead of "The capital of France is Paris.").
VLLM_DTYPE = "float32"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(kind: str, python: str, model: str, port: int) -> list[str]:
    if kind == "vllm":
        return [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-log-requests", "--dtype", VLLM_DTYPE, "--max-model-len", "2048",
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


def main(argv: list[str]) -> int:
    kind, python, model = argv
    if kind not in {"vllm", "llamacpp"}:
        print(f"unknown server kind {kind!r}: vllm or llamacpp")
        return 2
    if kind == "vllm" and (problem := model_dir_problem(Path(model))):
        print(problem)
        return 1
    port = free_port()
    log_path = Path(f"{kind}-server.log").resolve()
    command = server_command(kind, python, model, port)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
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
            test_env = {**os.environ, f"{prefix}_URL": url, f"{prefix}_LOG": str(log_path)}
            return subprocess.call(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-m",
                    kind,
                    "-s",
                    "-q",
                    f"tests/integration/test_{kind}.py",
                ],
                env=test_env,
            )
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
