"""Local model throughput, alone and batched, in one run.

    python -m proxy.bench.local [--tokens 128] [--stream-tokens 64] [--repeat 2]
                                [--single-repeat 3] [--turns 6] [--turn-tokens 80]
                                [--only single,turns,engine,concurrent,llamacpp]
                                [--llamacpp .llamacpp-venv/bin/python]
                                [--markdown docs/benchmarks.md]

1. ``model.generate`` (transformers, greedy, exactly N new tokens): the baseline.
2. Sluice's own decode loop, called directly (no HTTP): the engine with one sequence.
3. The same request through ``sluice serve`` (a subprocess, the local model behind the relay,
   streamed over HTTP): what a client gets. 1-3 alternate, best of ``--single-repeat``.
3b. A chat of ``--turns`` turns (each turn the whole history, the previous answer included, and
   a new question) through a batching ``sluice serve`` with its prefix cache and through one
   with ``prefix_cache_bytes = 0``, alternating: each turn's prompt tokens and TTFT.
4. 1, 2, 4 and 8 concurrent streams through two ``sluice serve`` processes, one batching
   (``slots = 8``) and one generating one at a time (``slots = 1``), alternating: aggregate
   and per-stream tokens/s, TTFT p50/p99.
5. The engine in this process, stepped in a thread of its own: cancel-to-freed-slot latency and
   the others' step time around each leave, and the running streams' step time while a long
   prompt joins, chunked and whole.
6. llama.cpp's server (llama-cpp-python, as ``make test-llamacpp`` builds it) on the same GGUF
   beside ``sluice serve``: one stream, and 8 at once, alternating.

Each single-stream figure is the median of ``--repeat`` runs; ratios are against
``model.generate`` measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
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
from inference.quality import cpu_model
from proxy.bench import llamacpp as llamacpp_bench
from proxy.bench.children import free_port
from proxy.bench.headings import unique_headings

QUESTION = "Write a long story about a lighthouse keeper and the sea."
SECTION_MARK = "<!-- bench-local -->"
# What tells this section from the others when a heading has to (proxy.bench.headings).
SECTION_KEY = "bench=local"


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


def start_proxy(
    port: int,
    workdir: Path,
    slots: int = 1,
    prefix_cache_bytes: int | None = None,
    weights: str | None = None,
) -> subprocess.Popen[bytes]:
    name = (
        f"local-{slots}"
        + ("" if prefix_cache_bytes is None else f"-{prefix_cache_bytes}")
        + ("" if weights is None else f"-{weights}")
    )
    config = workdir / f"{name}.toml"
    config.write_text(
        f'[server]\nport = {port}\n[models.smollm2]\nbackend = "local"\n'
        f'path = "{SMOLLM2_PACKAGE}"\nslots = {slots}\nmax_queue = 16\nqueue_timeout = 900\n'
        + ("" if prefix_cache_bytes is None else f"prefix_cache_bytes = {prefix_cache_bytes}\n")
        + ("" if weights is None else f'weights = "{weights}"\n')
    )
    log = (workdir / f"proxy-{name}.log").open("wb")
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
            # /healthz answers while the model loads; "ok" once it is served.
            health = httpx.get(url + "/healthz", timeout=1, trust_env=False)
            if health.status_code == 200 and health.json().get("status") == "ok":
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("sluice serve did not become ready in time")


QUESTIONS = (
    "Write a long story about a lighthouse keeper and the sea.",
    "Tell me about rivers.",
    "Explain how birds fly.",
    "Describe a walk through a forest in autumn.",
    "What makes the sky blue?",
    "Write a letter to a friend about a trip to the mountains.",
    "How does a bicycle work?",
    "Describe the life of a honeybee.",
)
CONCURRENCY = (1, 2, 4, 8)
TURN_QUESTIONS = (
    "Tell me about lighthouses.",
    "Why are they painted in stripes?",
    "Who kept them before automation?",
    "What did a keeper do at night?",
    "Which is the oldest one still working?",
    "Write a short poem about one.",
    "Summarise what we talked about.",
    "Thank you. One last fact?",
)


def measure_turns(url: str, turns: int, tokens: int, chat: int = 0) -> list[dict[str, float]]:
    """One chat of ``turns`` turns, each sending the whole history (the previous answers as
    the model wrote them) and a new question: each turn's prompt tokens and TTFT. Chats of
    different numbers share only the model's default system prompt."""
    messages: list[dict[str, str]] = []
    rows = []
    with httpx.Client(timeout=900, trust_env=False) as client:
        for turn in range(turns):
            question = TURN_QUESTIONS[turn % len(TURN_QUESTIONS)]
            messages.append(
                {"role": "user", "content": f"Chat {chat}. {question}" if turn == 0 else question}
            )
            body = {
                "model": "smollm2",
                "messages": messages,
                "stream": True,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            started = time.perf_counter()
            first = 0.0
            answer: list[str] = []
            prompt_tokens = 0
            with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        prompt_tokens = int(event["usage"]["prompt_tokens"])
                    for choice in event.get("choices", ()):
                        text = choice.get("delta", {}).get("content")
                        if text:
                            first = first or time.perf_counter()
                            answer.append(text)
            messages.append({"role": "assistant", "content": "".join(answer)})
            rows.append({"prompt_tokens": prompt_tokens, "ttft_s": first - started})
    return rows


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


async def _timed_stream(
    client: httpx.AsyncClient, url: str, question: str, tokens: int
) -> tuple[float, float, float]:
    """One streamed request: (its start, its first token, its last token), perf_counter."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    first = last = 0.0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                last = time.perf_counter()
                first = first or last
    return started, first, last


def measure_concurrent(url: str, streams: int, tokens: int) -> dict[str, Any]:
    """``streams`` requests at once: aggregate tokens/s, each stream's rate after its first
    token, and the TTFTs."""
    import trio

    timings: list[tuple[float, float, float]] = []

    async def main() -> None:
        async with httpx.AsyncClient(timeout=900, trust_env=False) as client:

            async def one(index: int) -> None:
                question = QUESTIONS[index % len(QUESTIONS)]
                timings.append(await _timed_stream(client, url, question, tokens))

            async with trio.open_nursery() as nursery:
                for index in range(streams):
                    nursery.start_soon(one, index)

    began = time.perf_counter()
    trio.run(main)
    wall = time.perf_counter() - began
    rates = [(tokens - 1) / (last - first) for _, first, last in timings if last > first]
    ttfts = [first - start for start, first, _ in timings]
    return {
        "streams": streams,
        "aggregate_tokens_per_s": streams * tokens / wall,
        "stream_tokens_per_s": statistics.median(rates),
        "stream_tokens_per_s_min": min(rates),
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p99_s": _quantile(ttfts, 0.99),
    }


class _EngineRig:
    """The batch engine in a thread of its own, as the server runs it, recording when each
    sequence left and when each decode step ended."""

    def __init__(self, generator: Generator, prefill_chunk: int, max_batch: int = 8) -> None:
        import threading

        from inference.batching import BatchEngine

        self.left: dict[Any, float] = {}
        self.first_piece: dict[Any, float] = {}
        self.step_ends: list[tuple[float, int]] = []
        self.engine = BatchEngine(
            generator,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            deliver=self._deliver,
            on_step=lambda size, _: self.step_ends.append((time.perf_counter(), size)),
        )
        self.thread = threading.Thread(target=self.engine.run, name="bench engine")

    def _deliver(self, pieces: list[tuple[Any, Any]], gone: list[Any]) -> None:
        now = time.perf_counter()
        for sequence, _ in pieces:
            sequence.consumed += 1
            self.first_piece.setdefault(sequence, now)
        for sequence in gone:
            self.left[sequence] = now

    def __enter__(self) -> _EngineRig:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.engine.stop()
        self.thread.join()

    def wait(self, predicate: Any, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not get there in time")
            time.sleep(0.001)

    def wait_steps(self, count: int) -> None:
        target = len(self.step_ends) + count
        self.wait(lambda: len(self.step_ends) >= target)

    def gaps(self, since: float, until: float) -> list[float]:
        """The time between consecutive decode steps ending in [since, until]: the gap a
        running stream sees between its tokens."""
        ends = [end for end, _ in self.step_ends]
        return [b - a for a, b in itertools.pairwise(ends) if since <= a and b <= until]


def _endless(generator: Generator, question: str) -> Any:
    from inference.batching import Generation

    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    return Generation(generator.chat_prompt([{"role": "user", "content": question}]), params)


def measure_leaves(generator: Generator, rounds: int = 2, leaves: int = 4) -> dict[str, Any]:
    """Eight sequences decoding; one by one, ``leaves`` of them are cancelled (``rounds``
    times). Per leave: from the flag to the sequence out of the batch. The others' step gaps:
    the one just after each leave against those in the ten steps before it, pooled."""
    latencies, before, after = [], [], []
    for _ in range(rounds):
        with _EngineRig(generator, prefill_chunk=32) as rig:
            sequences = [_endless(generator, question) for question in QUESTIONS]
            for sequence in sequences:
                rig.engine.submit(sequence)
            rig.wait(lambda rig=rig: rig.engine.batch_size == len(QUESTIONS))
            rig.wait_steps(12)
            for victim in sequences[:leaves]:
                window_start = rig.step_ends[-11][0]
                flagged = time.perf_counter()
                victim.cancelled = True
                rig.engine.wake()
                rig.wait(lambda rig=rig, victim=victim: victim in rig.left)
                latencies.append(rig.left[victim] - flagged)
                rig.wait_steps(12)
                before.extend(rig.gaps(window_start, flagged))
                left_at = rig.left[victim]
                previous = max(end for end, _ in rig.step_ends if end <= left_at)
                following = min(end for end, _ in rig.step_ends if end > left_at)
                after.append(following - previous)
            for sequence in sequences:
                sequence.cancelled = True
            rig.engine.wake()
            rig.wait(lambda rig=rig: rig.engine.sequences == 0)
    return {
        "leaves": len(latencies),
        "cancel_to_free_ms_p50": round(_quantile(latencies, 0.5) * 1000, 1),
        "cancel_to_free_ms_max": round(max(latencies) * 1000, 1),
        "step_before_p50_ms": round(_quantile(before, 0.5) * 1000, 1),
        "step_before_p99_ms": round(_quantile(before, 0.99) * 1000, 1),
        "step_after_p99_ms": round(_quantile(after, 0.99) * 1000, 1),
        "growth": _quantile(after, 0.99) / _quantile(before, 0.99),
    }


LONG_PROMPT = " ".join(
    ["The river ran past the old mill, under the stone bridge and through the fields."] * 28
)


def measure_join(generator: Generator, prefill_chunk: int, running: int = 4) -> dict[str, Any]:
    """``running`` sequences decoding while one with a ~500-token prompt joins: the running
    streams' worst step gap during its prefill, against their median gap before."""
    from inference.batching import Generation

    with _EngineRig(generator, prefill_chunk=prefill_chunk) as rig:
        sequences = [_endless(generator, question) for question in QUESTIONS[:running]]
        for sequence in sequences:
            rig.engine.submit(sequence)
        rig.wait(lambda: rig.engine.batch_size == running)
        rig.wait_steps(12)
        steady_from = rig.step_ends[-11][0]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        joining = Generation(generator.text_prompt(LONG_PROMPT), params)
        submitted = time.perf_counter()
        rig.engine.submit(joining)
        rig.wait(lambda: joining in rig.first_piece)
        joined = rig.first_piece[joining]
        rig.wait_steps(3)
        steady = rig.gaps(steady_from, submitted)
        # Up to the first step after its first token: the gap that held its last chunk.
        until = min(end for end, _ in rig.step_ends if end > joined)
        during = rig.gaps(submitted, until)
        for sequence in sequences:
            sequence.cancelled = True
        rig.engine.wake()
        rig.wait(lambda: rig.engine.sequences == 0)
    return {
        "prefill_chunk": prefill_chunk,
        "prompt_tokens": len(joining.prompt_ids),
        "steady_gap_ms": round(statistics.median(steady) * 1000, 1),
        "worst_gap_ms": round(max(during) * 1000, 1) if during else None,
        "time_to_first_token_ms": round((joined - submitted) * 1000, 1),
    }


SECTIONS = ("startup", "single", "turns", "engine", "concurrent", "llamacpp")


# Start-up: the default weights, and float32 (the layout that needs no 4-bit packing).
STARTUP_WEIGHTS = ("auto", "float32")


def measure_startup(workdir: Path, repeat: int) -> dict[str, list[float]]:
    """Seconds from starting `sluice serve` (slots = 8) to its /readyz answering 200: the time
    until the first request can be served; each weights choice in turn, ``repeat`` times."""
    seconds: dict[str, list[float]] = {weights: [] for weights in STARTUP_WEIGHTS}
    for _ in range(repeat):
        for weights in STARTUP_WEIGHTS:
            port = free_port("127.0.0.1")
            started = time.monotonic()
            process = start_proxy(port, workdir, 8, weights=weights)
            try:
                wait_ready(f"http://127.0.0.1:{port}", process, started + 300)
                seconds[weights].append(round(time.monotonic() - started, 2))
            finally:
                process.terminate()
                process.wait(timeout=30)
    return seconds


def run(
    tokens: int,
    repeat: int,
    stream_tokens: int,
    *,
    single_repeat: int = 3,
    turns: int = 6,
    turn_tokens: int = 80,
    only: tuple[str, ...] = SECTIONS,
    llamacpp: Path | None = None,
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "tokens": tokens,
        "stream_tokens": stream_tokens,
        "repeat": repeat,
        "single_repeat": single_repeat,
        "prompt_tokens": 0,
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }
    modes: dict[str, tuple[int, int | None]] = {"batched": (8, None)}
    if "concurrent" in only:
        modes["serial"] = (1, None)
    if "turns" in only:
        modes["no prefix cache"] = (8, 0)
    with tempfile.TemporaryDirectory() as workdir:
        if "startup" in only:
            # First, while no other server holds a core.
            print("start-up ...", file=sys.stderr)
            results["startup"] = measure_startup(Path(workdir), single_repeat)
        processes = {}
        urls = {}
        try:
            for mode, (slots, prefix_cache_bytes) in modes.items():
                port = free_port("127.0.0.1")
                urls[mode] = f"http://127.0.0.1:{port}"
                processes[mode] = start_proxy(port, Path(workdir), slots, prefix_cache_bytes)
            print(
                f"loading {SMOLLM2_PACKAGE}, starting {len(modes)} sluice serve ...",
                file=sys.stderr,
            )
            for mode in processes:
                wait_ready(urls[mode], processes[mode], time.monotonic() + 300)
                measure_proxy(urls[mode], 8)  # warm-up
            if "llamacpp" in only and llamacpp is not None:
                port = free_port("127.0.0.1")
                urls["llamacpp"] = f"http://127.0.0.1:{port}"
                processes["llamacpp"] = llamacpp_bench.start(llamacpp, port, Path(workdir))
                llamacpp_bench.wait_ready(
                    urls["llamacpp"], processes["llamacpp"], time.monotonic() + 300
                )
                llamacpp_bench.measure(urls["llamacpp"], 1, 8, QUESTIONS)  # warm-up
            if "turns" in only:
                print("multi-turn chats ...", file=sys.stderr)
                results["turns"] = _turns(urls, turns, turn_tokens, single_repeat)
            if "single" in only or "engine" in only:
                # The model in this process too: one more copy in memory, only for these.
                results.update(_in_process(urls, tokens, single_repeat, only))
                gc.collect()
            if "concurrent" in only:
                results["concurrent"] = _concurrent(urls, repeat, stream_tokens)
            if "llamacpp" in only:
                if llamacpp is None:
                    results["llamacpp"] = None
                else:
                    results["llamacpp"] = llamacpp_bench.compare(
                        urls, single_repeat, stream_tokens, QUESTIONS
                    )
                    results["llamacpp"]["generate_tokens_per_s"] = results.get(
                        "generate_tokens_per_s"
                    )
        finally:
            for process in processes.values():
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    return results


def _in_process(
    urls: dict[str, str], tokens: int, single_repeat: int, only: tuple[str, ...]
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    loaded = load_model(SMOLLM2_PACKAGE, "smollm2")
    generator = Generator(loaded)
    prompt_ids = generator.chat_prompt([{"role": "user", "content": QUESTION}])
    results["prompt_tokens"] = len(prompt_ids)
    measure_generate(loaded, prompt_ids, 8)  # warm-up
    if "single" in only:
        results.update(_single(loaded, generator, prompt_ids, urls, tokens, single_repeat))
    if "engine" in only:
        print("engine: leaves and joins ...", file=sys.stderr)
        results["leaves"] = measure_leaves(generator)
        results["joins"] = [measure_join(generator, 32), measure_join(generator, 1_000_000)]
    return results


def _single(
    loaded: Any,
    generator: Generator,
    prompt_ids: list[int],
    urls: dict[str, str],
    tokens: int,
    repeat: int,
) -> dict[str, Any]:
    """One stream, alternating (this machine's speed drifts within minutes): the model here
    (the proxies idle meanwhile), then through the batching proxy; best of ``repeat``."""
    generate: list[float] = []
    loop: list[float] = []
    proxy: list[float] = []
    for _ in range(repeat):
        generate.append(measure_generate(loaded, prompt_ids, tokens))
        loop.append(measure_loop(generator, prompt_ids, tokens))
        proxy.append(measure_proxy(urls["batched"], tokens))
    baseline = max(generate)
    return {
        "generate_tokens_per_s": baseline,
        "loop_tokens_per_s": max(loop),
        "proxy_tokens_per_s": max(proxy),
        "loop_vs_generate": max(loop) / baseline,
        "proxy_vs_generate": max(proxy) / baseline,
        "samples": {"generate": generate, "loop": loop, "proxy": proxy},
    }


def _turns(urls: dict[str, str], turns: int, tokens: int, repeat: int) -> dict[str, Any]:
    """The same chats with and without the prefix cache, alternating; per turn, the best TTFT
    of ``repeat`` chats (each its own first question, so one chat does not hit another's
    turns; greedy, so both servers see the same prompts)."""
    runs: dict[str, list[list[dict[str, float]]]] = {"cached": [], "uncached": []}
    for chat in range(repeat):
        runs["cached"].append(measure_turns(urls["batched"], turns, tokens, chat))
        runs["uncached"].append(measure_turns(urls["no prefix cache"], turns, tokens, chat))
    table = {}
    for mode, chats in runs.items():
        table[mode] = [
            {
                "prompt_tokens": chats[0][turn]["prompt_tokens"],
                "ttft_s": min(chat[turn]["ttft_s"] for chat in chats),
            }
            for turn in range(turns)
        ]
    return table


def _concurrent(urls: dict[str, str], repeat: int, stream_tokens: int) -> dict[str, Any]:
    concurrent: dict[str, dict[int, list[dict[str, Any]]]] = {"batched": {}, "serial": {}}
    for _ in range(repeat):
        for streams in CONCURRENCY:
            for mode in ("batched", "serial"):
                print(f"{mode}: {streams} streams ...", file=sys.stderr)
                concurrent[mode].setdefault(streams, []).append(
                    measure_concurrent(urls[mode], streams, stream_tokens)
                )

    def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {key: statistics.median(run[key] for run in runs) for key in runs[0]}

    return {
        mode: {streams: median_of(runs) for streams, runs in by_streams.items()}
        for mode, by_streams in concurrent.items()
    }


def write_plot(results: dict[str, Any], path: Path) -> None:
    from proxy.bench.plots import load_pyplot

    plt = load_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, label in (
        ("batched", "batched (slots = 8)"),
        ("serial", "one at a time (slots = 1)"),
    ):
        rows = results["concurrent"][mode]
        streams = sorted(rows)
        left.plot(streams, [rows[k]["aggregate_tokens_per_s"] for k in streams], "o-", label=label)
        right.plot(streams, [rows[k]["stream_tokens_per_s"] for k in streams], "o-", label=label)
    for ax, title in ((left, "aggregate tokens/s"), (right, "tokens/s of each stream (median)")):
        ax.set_xlabel("concurrent streams")
        ax.set_xticks(list(CONCURRENCY))
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle("SmolLM2-135M on this machine's CPU, through sluice serve")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


READING = (
    "Reading: a forward pass over more rows costs more than one row's, far less than in "
    "proportion, since every row shares one read of the weights: with the 4-bit weights one "
    "row's decode step took 12-14 ms and 8 rows' 26-31 ms (SmolLM2-135M, the serving forward "
    "alone, alternating in one process). So 8 streams gain most, and `slots = 8` is the "
    "default. A joining prompt's chunk is a forward pass of its own beside the batch's step, "
    "so the running streams' gap while a long prompt joins is their step plus the chunk's."
)


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def markdown(results: dict[str, Any], command: str, plot: str | None = None) -> str:
    meminfo = Path("/proc/meminfo").read_text().split()
    ram_gib = int(meminfo[1]) / 1024 / 1024 if meminfo[:1] == ["MemTotal:"] else float("nan")
    lines = [
        SECTION_MARK,
        "## Local model: one stream vs `model.generate`, a chat's turns, many streams in one batch",
        "",
        f"- Machine: {os.cpu_count()} cores ({cpu_model()}), {ram_gib:.1f} GiB RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}; load "
        f"average at the start {' / '.join(str(v) for v in results['load_average'])}",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Command: `{command}`",
        "- Model: SmolLM2-135M-Instruct (Q4_1 GGUF); `model.generate` in float32 with "
        "torch's default threads, Sluice with its default `weights = \"auto\"` (the file's "
        "4-bit weights through torch's 4-bit kernel, the quality gate's path); greedy.",
        "",
    ]
    if "startup" in results:
        lines += _startup_lines(results)
    if "generate_tokens_per_s" in results:
        lines += _single_lines(results)
    if "turns" in results:
        lines += _turn_lines(results)
    if "concurrent" in results:
        lines += _concurrent_lines(results)
    if "leaves" in results:
        lines += _engine_lines(results)
    if "llamacpp" in results:
        lines += llamacpp_bench.markdown_lines(results)
    if plot and "concurrent" in results:
        lines += [f"![Aggregate and per-stream tokens/s, batched and one at a time]({plot})", ""]
    return "\n".join(lines)


def _startup_lines(results: dict[str, Any]) -> list[str]:
    startup = results["startup"]
    lines = [
        "Start-up: from starting `sluice serve` (`slots = 8`) to `/readyz` answering 200, "
        "the time until the first request can be served; alternating, each run listed.",
        "",
        "| weights | seconds | median |",
        "|---|---|---|",
    ]
    for weights, seconds in startup.items():
        listed = " / ".join(f"{value:.1f}" for value in seconds)
        lines.append(f"| `{weights}` | {listed} | {statistics.median(seconds):.1f} |")
    lines += [
        "",
        "There is no compiled variant to wait for: compiling the step made it slower "
        "(`docs/local-model.md` has the figures), so eager is ready when serving is.",
        "",
    ]
    return lines


def _single_lines(results: dict[str, Any]) -> list[str]:
    ratio = results["proxy_vs_generate"]
    return [
        f"One stream: {results['tokens']} new tokens after a {results['prompt_tokens']}-token "
        f"chat prompt, best of {results['single_repeat']} alternating runs each.",
        "",
        "| path | tokens/s | vs generate |",
        "|---|---|---|",
        f"| `model.generate` (baseline) | {results['generate_tokens_per_s']:.1f} | 1.00x |",
        f"| Sluice's engine, one sequence, no HTTP | {results['loop_tokens_per_s']:.1f} | "
        f"{results['loop_vs_generate']:.2f}x |",
        f"| through `sluice serve` (`slots = 8`), streamed over HTTP | "
        f"{results['proxy_tokens_per_s']:.1f} | {ratio:.2f}x |",
        "",
        f"- one stream through `sluice serve` >= 2x `model.generate`: {ratio:.2f}x, "
        f"**{_verdict(ratio >= 2)}**.",
        "",
    ]


def _turn_lines(results: dict[str, Any]) -> list[str]:
    cached, uncached = results["turns"]["cached"], results["turns"]["uncached"]
    lines = [
        f"A chat of {len(cached)} turns ({TURN_QUESTIONS[0]!r} and on), each turn the whole "
        "history with the previous answers and a new question, through two `sluice serve` "
        "(`slots = 8`): the default prefix cache, and `prefix_cache_bytes = 0`; alternating, "
        f"best TTFT of {results['single_repeat']} per turn.",
        "",
        "| turn | prompt tokens | TTFT, prefix cache | TTFT, no prefix cache |",
        "|---|---|---|---|",
    ]
    for turn, (hit, miss) in enumerate(zip(cached, uncached, strict=True), start=1):
        lines.append(
            f"| {turn} | {hit['prompt_tokens']} | {hit['ttft_s']:.2f} s | {miss['ttft_s']:.2f} s |"
        )
    growth = cached[-1]["ttft_s"] / cached[0]["ttft_s"]
    lines += [
        "",
        f"- turn {len(cached)}'s TTFT <= 1.5x turn 1's, with the prefix cache: {growth:.2f}x, "
        f"**{_verdict(growth <= 1.5)}** (without it: "
        f"{uncached[-1]['ttft_s'] / uncached[0]['ttft_s']:.2f}x).",
        "",
    ]
    return lines


def _concurrent_lines(results: dict[str, Any]) -> list[str]:
    batched, serial = results["concurrent"]["batched"], results["concurrent"]["serial"]
    lines = [
        f"Concurrent streams: {results['stream_tokens']} tokens each, a different question each, "
        "through two `sluice serve` processes (`slots = 8` batched, `slots = 1` one at a time) "
        f"measured alternately, median of {results['repeat']}.",
        "",
        "| streams | batched: aggregate tok/s | batched: per stream | batched: TTFT p50 / p99 "
        "(ms) | one at a time: aggregate tok/s | one at a time: per stream | one at a time: "
        "TTFT p50 / p99 (ms) | batched / one at a time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for streams in CONCURRENCY:
        b, o = batched[streams], serial[streams]
        lines.append(
            f"| {streams} | {b['aggregate_tokens_per_s']:.1f} | {b['stream_tokens_per_s']:.1f} "
            f"| {b['ttft_p50_s'] * 1000:.0f} / {b['ttft_p99_s'] * 1000:.0f} "
            f"| {o['aggregate_tokens_per_s']:.1f} | {o['stream_tokens_per_s']:.1f} "
            f"| {o['ttft_p50_s'] * 1000:.0f} / {o['ttft_p99_s'] * 1000:.0f} "
            f"| {b['aggregate_tokens_per_s'] / o['aggregate_tokens_per_s']:.2f}x |"
        )
    one, eight = batched[1], batched[8]
    lines += ["", "Targets, same run:"]
    if "generate_tokens_per_s" in results:
        versus = eight["aggregate_tokens_per_s"] / results["generate_tokens_per_s"]
        lines.append(
            f"- 8 streams' aggregate >= 4x `model.generate`: {versus:.2f}x, "
            f"**{_verdict(versus >= 4)}**."
        )
    lines += [
        f"- 8 streams' aggregate is >= 3x one stream's: "
        f"{eight['aggregate_tokens_per_s'] / one['aggregate_tokens_per_s']:.2f}x, **"
        f"{_verdict(eight['aggregate_tokens_per_s'] >= 3 * one['aggregate_tokens_per_s'])}**.",
        f"- each of 8 streams runs at >= 0.35x one stream's rate: slowest "
        f"{eight['stream_tokens_per_s_min'] / one['stream_tokens_per_s']:.2f}x, **"
        f"{_verdict(eight['stream_tokens_per_s_min'] >= 0.35 * one['stream_tokens_per_s'])}**.",
        "",
    ]
    return lines


def _engine_lines(results: dict[str, Any]) -> list[str]:
    leaves, (chunked, whole) = results["leaves"], results["joins"]
    return [
        f"- a cancelled sequence leaves within one step, and the others' step after a leave "
        f"is no more than 1.1x their p99 before ({leaves['leaves']} leaves from a batch of 8): "
        f"cancel to freed slot p50 {leaves['cancel_to_free_ms_p50']} ms, max "
        f"{leaves['cancel_to_free_ms_max']} ms, against steps of "
        f"{leaves['step_before_p50_ms']} ms p50 / {leaves['step_before_p99_ms']} ms p99 before; "
        f"the step after a leave {leaves['step_after_p99_ms']} ms p99, "
        f"{leaves['growth']:.2f}x, **{_verdict(leaves['growth'] <= 1.1)}**.",
        f"- a {chunked['prompt_tokens']}-token prompt joining 4 running streams: their worst "
        f"step gap during its prefill is {chunked['worst_gap_ms']} ms in chunks of "
        f"{chunked['prefill_chunk']} tokens (steady: {chunked['steady_gap_ms']} ms; its first "
        f"token after {chunked['time_to_first_token_ms']:.0f} ms), against "
        f"{whole['worst_gap_ms']} ms prefilled whole (steady {whole['steady_gap_ms']} ms; first "
        f"token after {whole['time_to_first_token_ms']:.0f} ms).",
        "",
        "Cancel to freed slot is measured in the engine: from the cancelled flag to the "
        "sequence out of the batch. The HTTP figure, from the client's close, is "
        "`sluice_cancel_propagation_seconds`. Per-stream tokens/s counts from a stream's "
        "first token to its last.",
        "",
        READING,
        "",
    ]


def write_markdown(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION_MARK in text:
        before, _, after = text.partition(SECTION_MARK)
        # The section runs to the next "<!--" marker or the end.
        rest = after.split("\n<!--", 1)
        after = "\n<!--" + rest[1] if len(rest) > 1 else ""
        text = before + unique_headings(section, SECTION_KEY, before + after) + after
    else:
        text = text.rstrip("\n") + "\n\n" + unique_headings(section, SECTION_KEY, text)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.bench.local", description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--single-repeat", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=80)
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"a comma-separated subset of {SECTIONS}"
    )
    parser.add_argument("--markdown", type=Path, help="write/replace a section in this file")
    parser.add_argument(
        "--llamacpp",
        type=Path,
        default=llamacpp_bench.PYTHON if llamacpp_bench.PYTHON.exists() else None,
        help="a Python with llama-cpp-python[server], measured beside Sluice (default: "
        f"{llamacpp_bench.PYTHON} when `make test-llamacpp` has built it)",
    )
    args = parser.parse_args(argv)
    only = tuple(part for part in args.only.split(",") if part)
    if unknown := set(only) - set(SECTIONS):
        parser.error(f"unknown sections: {sorted(unknown)}")
    results = run(
        args.tokens,
        args.repeat,
        args.stream_tokens,
        single_repeat=args.single_repeat,
        turns=args.turns,
        turn_tokens=args.turn_tokens,
        only=only,
        llamacpp=args.llamacpp,
    )
    print(json.dumps(results, indent=1, default=str))
    if args.markdown:
        plot = args.markdown.parent / "local-batching.png"
        write_plot(results, plot)
        command = "python -m proxy.bench.local " + " ".join(argv or sys.argv[1:])
        write_markdown(args.markdown, markdown(results, command.strip(), plot.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
