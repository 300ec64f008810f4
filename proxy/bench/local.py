"""Local model throughput: tokens/s through the proxy vs ``model.generate`` alone, same run.

    python -m proxy.bench.local [--tokens 128] [--repeat 3] [--markdown docs/benchmarks.md]

1. ``model.generate`` (transformers, greedy, exactly N new tokens): the baseline.
2. Sluice's own decode loop, called directly (no HTTP): what the worker thread does.
3. The same request through ``sluice serve`` (a subprocess, the local model behind the relay,
   streamed over HTTP): what a client gets.

Each is run ``--repeat`` times and the median is reported; the proxy's figure is given as a
ratio of the baseline (the target is >= 0.95).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from inference import Generator, SamplingParams, load_model
from inference.loading import SMOLLM2_PACKAGE

QUESTION = "Write a long story about a lighthouse keeper and the sea."
SECTION_MARK = "<!-- bench-local -->"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure_generate(loaded: Any, prompt_ids: list[int], tokens: int) -> float:
    import torch

    inputs = torch.tensor([prompt_ids])
    started = time.perf_counter()
    with torch.inference_mode():
        output = loaded.model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=loaded.tokenizer.eos_token_id,
        )
    elapsed = time.perf_counter() - started
    produced = int(output.shape[1]) - len(prompt_ids)
    assert produced == tokens, produced
    return tokens / elapsed


def measure_loop(generator: Generator, prompt_ids: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    result = generator.generate(prompt_ids, params, emit=lambda text: None, checkpoint=lambda: None)
    elapsed = time.perf_counter() - started
    assert result.usage.completion_tokens == tokens
    return tokens / elapsed


def measure_proxy(url: str, tokens: int) -> float:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    completion_tokens = 0
    with (
        httpx.Client(timeout=300, trust_env=False) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if '"usage"' in line:
                completion_tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
    elapsed = time.perf_counter() - started
    assert completion_tokens == tokens, completion_tokens
    return tokens / elapsed


def start_proxy(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    config = workdir / "local.toml"
    config.write_text(
        f'[server]\nport = {port}\n[models.smollm2]\nbackend = "local"\n'
        f'path = "{SMOLLM2_PACKAGE}"\n'
    )
    log = (workdir / "proxy.log").open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "--log-level",
            "WARNING",
            "serve",
            "--config",
            str(config),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def wait_ready(url: str, process: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("sluice serve did not become ready in time")


def run(tokens: int, repeat: int) -> dict[str, Any]:
    print(f"loading {SMOLLM2_PACKAGE} ...", file=sys.stderr)
    loaded = load_model(SMOLLM2_PACKAGE, "smollm2")
    generator = Generator(loaded)
    prompt_ids = generator.chat_prompt([{"role": "user", "content": QUESTION}])
    measure_generate(loaded, prompt_ids, 8)  # warm-up
    generate = [measure_generate(loaded, prompt_ids, tokens) for _ in range(repeat)]
    loop = [measure_loop(generator, prompt_ids, tokens) for _ in range(repeat)]
    # The proxy runs the model in its own process; free ours so that they do not compete.
    del generator, loaded
    gc.collect()
    with tempfile.TemporaryDirectory() as workdir:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        process = start_proxy(port, Path(workdir))
        try:
            print("starting sluice serve ...", file=sys.stderr)
            wait_ready(url, process, time.monotonic() + 300)
            measure_proxy(url, 8)  # warm-up
            proxy = [measure_proxy(url, tokens) for _ in range(repeat)]
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    baseline = statistics.median(generate)
    return {
        "tokens": tokens,
        "repeat": repeat,
        "prompt_tokens": len(prompt_ids),
        "generate_tokens_per_s": baseline,
        "loop_tokens_per_s": statistics.median(loop),
        "proxy_tokens_per_s": statistics.median(proxy),
        "loop_vs_generate": statistics.median(loop) / baseline,
        "proxy_vs_generate": statistics.median(proxy) / baseline,
        "samples": {"generate": generate, "loop": loop, "proxy": proxy},
    }


def markdown(results: dict[str, Any], command: str) -> str:
    meminfo = Path("/proc/meminfo").read_text().split()
    ram_gib = int(meminfo[1]) / 1024 / 1024 if meminfo[:1] == ["MemTotal:"] else float("nan")
    verdict = "met" if results["proxy_vs_generate"] >= 0.95 else "NOT met"
    return "\n".join(
        [
            SECTION_MARK,
            "## Local model: tokens/s through the proxy vs `model.generate`",
            "",
            f"- Machine: {os.cpu_count()} cores, {ram_gib:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
            f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            f"- Command: `{command}`",
            f"- Model: SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32), greedy, "
            f"{results['tokens']} new tokens after a {results['prompt_tokens']}-token chat "
            f"prompt, median of {results['repeat']} runs each",
            "",
            "| path | tokens/s | vs generate |",
            "|---|---|---|",
            f"| `model.generate` (baseline) | {results['generate_tokens_per_s']:.1f} | 1.00x |",
            f"| Sluice decode loop, no HTTP | {results['loop_tokens_per_s']:.1f} | "
            f"{results['loop_vs_generate']:.2f}x |",
            f"| through `sluice serve`, streamed over HTTP | {results['proxy_tokens_per_s']:.1f} | "
            f"{results['proxy_vs_generate']:.2f}x |",
            "",
            f"Target: the proxy keeps >= 0.95x of `model.generate`: **{verdict}**. The proxy "
            "figure includes the HTTP request, the prompt's prefill and every token's trip from "
            "the worker thread through the relay's channel to the socket.",
            "",
        ]
    )


def write_markdown(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION_MARK in text:
        before, _, after = text.partition(SECTION_MARK)
        # The section runs to the next "<!--" marker or the end.
        rest = after.split("\n<!--", 1)
        after = "\n<!--" + rest[1] if len(rest) > 1 else ""
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.bench.local", description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", type=Path, help="write/replace a section in this file")
    args = parser.parse_args(argv)
    results = run(args.tokens, args.repeat)
    print(
        f"model.generate: {results['generate_tokens_per_s']:.1f} tok/s\n"
        f"decode loop:    {results['loop_tokens_per_s']:.1f} tok/s "
        f"({results['loop_vs_generate']:.2f}x)\n"
        f"through proxy:  {results['proxy_tokens_per_s']:.1f} tok/s "
        f"({results['proxy_vs_generate']:.2f}x)"
    )
    if args.markdown:
        command = "python -m proxy.bench.local " + " ".join(argv or sys.argv[1:])
        write_markdown(args.markdown, markdown(results, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
