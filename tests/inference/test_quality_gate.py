"""The quality gate every local-model speed-up must pass: the serving path against float32
transformers on a fixed corpus (inference/quality.py), and its greedy answers to 20 chat prompts.

- On ``quality/corpus.txt`` (about 2,000 tokens of prose, code, French, a table, SQL, a letter),
  teacher-forced: a top-1 agreement with float32 of at least 98.5%, every disagreement a
  float32 near-tie (its own top token ahead by less than 0.5 logits), and a perplexity within
  1% of float32's (the margins and why: ``inference/quality.py``).
- Greedy answers (conf/local.toml's defaults) are the same run to run. They are pinned token for
  token by one golden file per CPU family (``quality/golden/<family>.json``: ``amd-epyc``),
  where the CPU, threads, torch and transformers releases are the file's; elsewhere the
  measures above are the check, and two runs must agree.

A path that fails stays opt-in (``weights = "int8"``: docs/benchmarks.md has its figures).
Write this CPU family's golden file (a new family's, or after a change judged by the measures;
never to make a test pass):

    .venv/bin/python -m tests.inference.test_quality_gate --write-golden
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from inference import quality
from inference.generation import Generator
from inference.loading import LoadedModel, load_model
from inference.sampling import SamplingParams
from tests.support import decode_to_the_end

HERE = Path(__file__).resolve().parent / "quality"
CORPUS = HERE / "corpus.txt"
PROMPTS = HERE / "prompts.json"
GOLDEN = HERE / "golden"
LOCAL_CONF = Path(__file__).resolve().parents[2] / "conf" / "local.toml"
# Long enough to tell answers apart, short enough for `make test`.
ANSWER_TOKENS = 32


def served_table() -> dict[str, Any]:
    table: dict[str, Any] = tomllib.loads(LOCAL_CONF.read_text())["models"]["smollm2"]
    return table


def load_served() -> LoadedModel:
    """SmolLM2 as `make run` serves it (conf/local.toml's weights)."""
    table = served_table()
    return load_model(table["path"], "smollm2", weights=table.get("weights", "auto"))


def greedy_answers(loaded: LoadedModel, prompts: Sequence[Any]) -> list[list[int]]:
    """Each prompt's answer token ids, through the batch engine as the server runs it (its
    slots, its prefill chunks) with conf/local.toml's defaults for a request that sets none."""
    table = served_table()
    generator = Generator(loaded)
    params = SamplingParams(
        max_tokens=ANSWER_TOKENS,
        temperature=float(table["default_temperature"]),
        repetition_penalty=float(table["default_repetition_penalty"]),
    )
    return decode_to_the_end(
        generator,
        [generator.chat_prompt(messages) for messages in prompts],
        params,
        max_batch=int(table["slots"]),
        prefill_chunk=int(table["prefill_chunk_tokens"]),
    )


@pytest.fixture(scope="module")
def served() -> LoadedModel:
    return load_served()


def test_the_serving_path_agrees_with_float32_on_the_corpus(served: LoadedModel) -> None:
    corpus = quality.corpus_ids(served.tokenizer, CORPUS.read_text())
    assert sum(len(ids) for ids in corpus) >= 2000  # "a few thousand tokens"
    if served_table().get("weights", "auto") != "int8":
        # The serving forward holds its own copy of the weights; the transformers model the
        # load kept is float32's own.
        reference_model = served.model
    else:
        reference_model = load_model(served_table()["path"], "reference").model
    measures = quality.measure(
        lambda ids: quality.reference_logits(reference_model, ids),
        lambda ids: quality.serving_logits(served.serving, ids),
        corpus,
    )
    print(measures.describe())
    assert measures.passes, measures.describe()


def test_greedy_answers_are_the_golden_ones(served: LoadedModel) -> None:
    prompts = json.loads(PROMPTS.read_text())
    assert len(prompts) == 20
    answers = greedy_answers(served, prompts)
    assert all(answers), "every prompt gets an answer"
    path = golden_file()
    golden = json.loads(path.read_text()) if path.exists() else None
    identity = quality.machine_identity()
    if golden is None or golden["identity"] != identity or golden["answer_tokens"] != ANSWER_TOKENS:
        # Another CPU family (or thread count, or release): its sums may round otherwise.
        # Greedy output must still be the same run to run.
        again = greedy_answers(served, prompts[:4])
        assert again == answers[:4]
        pinned = "no golden file" if golden is None else f"pinned for {golden['identity']}"
        pytest.skip(
            f"{path.name}: {pinned}, this is {identity}; the corpus measures and run-to-run "
            "equality were checked"
        )
    expected = [entry["tokens"] for entry in golden["answers"]]
    for index, (got, want) in enumerate(zip(answers, expected, strict=True)):
        assert got == want, (
            f"prompt {index} {prompts[index]!r}: "
            f"{served.tokenizer.decode(got)!r} != golden {served.tokenizer.decode(want)!r}"
        )


def test_one_decisive_disagreement_fails_the_gate_whatever_the_agreement() -> None:
    near_ties = quality.Measures(2297, 0.99, 17.04, 17.06, disagreement_margins=(0.094,) * 22)
    assert near_ties.passes and near_ties.decisive == 0
    one_decisive = dataclasses.replace(near_ties, disagreement_margins=(0.094, 0.6))
    assert one_decisive.decisive == 1 and not one_decisive.passes
    too_few = dataclasses.replace(near_ties, agreement=0.984)
    assert not too_few.passes
    off_perplexity = dataclasses.replace(near_ties, perplexity=17.06 * 1.011)
    assert not off_perplexity.passes


def golden_file() -> Path:
    """This CPU family's golden answers."""
    return GOLDEN / f"{quality.cpu_family()}.json"


def test_every_golden_file_is_named_for_the_cpu_that_wrote_it() -> None:
    files = sorted(GOLDEN.glob("*.json"))
    assert files
    for path in files:
        cpu = json.loads(path.read_text())["identity"]["cpu"]
        assert path.stem == re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-"), path


def write_golden() -> None:
    loaded = load_served()
    prompts = json.loads(PROMPTS.read_text())
    answers = greedy_answers(loaded, prompts)
    entries = [
        {"prompt": prompt, "text": loaded.tokenizer.decode(tokens), "tokens": tokens}
        for prompt, tokens in zip(prompts, answers, strict=True)
    ]
    head = {"identity": quality.machine_identity(), "answer_tokens": ANSWER_TOKENS}
    # One answer a line: a changed answer is one line of the diff.
    lines = [json.dumps(entry, ensure_ascii=False) for entry in entries]
    text = json.dumps(head, indent=1)[:-2] + ',\n "answers": [\n  ' + ",\n  ".join(lines)
    path = golden_file()
    path.write_text(text + "\n ]\n}\n")
    print(f"wrote {path} ({len(entries)} answers)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-golden"]:
        sys.exit(__doc__)
    write_golden()
