"""llama.cpp beside Sluice, for ``python -m proxy.bench.local``: llama-cpp-python's OpenAI
server on SmolLM2's GGUF (the anchor a user would pick instead of Sluice for a local model), and
the same requests to it and to ``sluice serve``, counted the same way."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

# Where `make test-llamacpp` builds llama-cpp-python (its server, on the same GGUF): the anchor
# a user would pick instead of Sluice for a local model.
PYTHON = Path(".llamacpp-venv/bin/python")
# SmolLM2's end of turn (<|im_end|>): llama.cpp's server has no ignore_eos, so its answers are
# made to run to max_tokens by an OpenAI logit_bias on it.
_SMOLLM2_END_OF_TURN = 2
STREAMS = 8


def start(python: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """llama-cpp-python's OpenAI server on SmolLM2's GGUF, with a thread per core (as
    Sluice's torch has by default)."""
    from inference.loading import locate_smollm2_gguf

    log = (workdir / "llamacpp.log").open("wb")
    command = [
        str(python), "-m", "llama_cpp.server", "--model", str(locate_smollm2_gguf()),
        "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 1),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, process: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {process.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama_cpp.server did not become ready in time")


async def _stream(
    client: httpx.AsyncClient, url: str, question: str, tokens: int, *, sluice: bool
) -> tuple[float, float, float, int]:
    """One streamed request that runs to ``tokens`` (Sluice: ``ignore_eos``; llama.cpp, which
    has none: its end of turn biased away): (its start, its first token, its last token, the
    tokens it streamed)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        # Sluice's local model takes no logit_bias; its ignore_eos does the same.
        **({"ignore_eos": True} if sluice else {"logit_bias": {str(_SMOLLM2_END_OF_TURN): -100}}),
    }
    started = time.perf_counter()
    first = last = 0.0
    count = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            # Parsed, not matched: llama.cpp's server writes its JSON with spaces.
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
                count += 1
    return started, first, last, count


def measure(
    url: str, streams: int, tokens: int, questions: Sequence[str], *, sluice: bool = False
) -> dict[str, Any]:
    """``streams`` requests at once, each event counted as a token: aggregate tokens/s (all
    tokens over the wall time) and one stream's rate (the median, after its first token)."""
    import trio

    timings: list[tuple[float, float, float, int]] = []

    async def main() -> None:
        async with httpx.AsyncClient(timeout=900, trust_env=False) as client:

            async def one(index: int) -> None:
                question = questions[index % len(questions)]
                timings.append(await _stream(client, url, question, tokens, sluice=sluice))

            async with trio.open_nursery() as nursery:
                for index in range(streams):
                    nursery.start_soon(one, index)

    began = time.perf_counter()
    trio.run(main)
    wall = time.perf_counter() - began
    made = sum(count for *_, count in timings)
    return {
        "streams": streams,
        "tokens": made,
        "aggregate_tokens_per_s": made / wall,
        "stream_tokens_per_s": statistics.median(
            (count - 1) / (last - first) for _, first, last, count in timings if last > first
        ),
    }


def compare(
    urls: dict[str, str], repeat: int, tokens: int, questions: Sequence[str]
) -> dict[str, Any]:
    """llama.cpp's server and Sluice's (``slots = 8``) on the same GGUF, the same requests
    (counted the same way), alternating: one stream, best of ``repeat``; and
    ``STREAMS`` at once, the best aggregate."""
    figures: dict[str, dict[str, list[float]]] = {
        server: {"one": [], "many": []} for server in ("llamacpp", "batched")
    }
    for _ in range(repeat):
        for server in figures:
            print(f"{server}: one stream, {STREAMS} streams ...", file=sys.stderr)
            sluice = server != "llamacpp"
            one = measure(urls[server], 1, tokens, questions, sluice=sluice)
            figures[server]["one"].append(one["aggregate_tokens_per_s"])
            many = measure(urls[server], STREAMS, tokens, questions, sluice=sluice)
            figures[server]["many"].append(many["aggregate_tokens_per_s"])
    return {
        server: {"one_tokens_per_s": max(f["one"]), "many_tokens_per_s": max(f["many"])}
        for server, f in figures.items()
    }


def markdown_lines(results: dict[str, Any]) -> list[str]:
    figures = results["llamacpp"]
    if figures is None:
        return [
            "llama.cpp: not measured (no llama-cpp-python: `make test-llamacpp` builds it in "
            f"`{PYTHON.parent.parent}`).",
            "",
        ]
    llamacpp, sluice = figures["llamacpp"], figures["batched"]
    generate = figures.get("generate_tokens_per_s")

    def against(value: float) -> str:
        return "" if not generate else f" ({value / generate:.2f}x generate)"

    return [
        f"Beside llama.cpp: llama-cpp-python's server (built by `make test-llamacpp`, AVX2, "
        f"{os.cpu_count()} threads) on the same GGUF and `sluice serve` (`slots = 8`), the same "
        f"requests ({results['stream_tokens']} tokens, the end of turn biased away since "
        "llama.cpp has no `ignore_eos`; each streamed event counted as a token), alternating; "
        f"best of {results['single_repeat']}.",
        "",
        f"| server | one stream, tok/s | {STREAMS} streams at once, aggregate tok/s |",
        "|---|---|---|",
        f"| llama.cpp | {llamacpp['one_tokens_per_s']:.1f}{against(llamacpp['one_tokens_per_s'])}"
        f" | {llamacpp['many_tokens_per_s']:.1f}{against(llamacpp['many_tokens_per_s'])} |",
        f"| Sluice | {sluice['one_tokens_per_s']:.1f}{against(sluice['one_tokens_per_s'])}"
        f" | {sluice['many_tokens_per_s']:.1f}{against(sluice['many_tokens_per_s'])} |",
        "",
    ]
