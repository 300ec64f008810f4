"""`make test-vllm`: start vLLM's OpenAI server on the converted SmolLM2, run the `vllm`-marked
tests against it through Sluice, stop it. Prints what the tests print (the abort timing).

    python -m tests.run_vllm VLLM_PYTHON MODEL_DIR
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

START_DEADLINE = 900  # vLLM's CPU start-up (compilation, warm-up) takes minutes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str]) -> int:
    vllm_python, model_dir = argv
    port = free_port()
    log_path = Path(model_dir).resolve().parent / "vllm-server.log"
    command = [
        vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", "smollm2",
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-log-requests", "--dtype", "bfloat16", "--max-model-len", "2048",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            started = time.monotonic()
            while True:
                if server.poll() is not None:
                    print(log_path.read_text(errors="replace")[-4000:])
                    print(f"vLLM exited with {server.returncode} during start-up")
                    return 1
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - started > START_DEADLINE:
                    print("vLLM did not become healthy in time")
                    return 1
                time.sleep(2)
            print(f"vLLM up on {url} after {time.monotonic() - started:.0f}s; log: {log_path}")
            test_env = {**os.environ, "SLUICE_VLLM_URL": url, "SLUICE_VLLM_LOG": str(log_path)}
            return subprocess.call(
                [sys.executable, "-m", "pytest", "-m", "vllm", "-s", "-q", "tests/test_vllm.py"],
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
