"""The quality gate's measures: a serving path's numerics judged against float32 transformers by
what its users see, its likeliest next token and its perplexity, rather than by bit-identity.

Float32 is not the model's own numerics either (SmolLM2 ships as a Q4_1 GGUF, dequantized); it is
one faithful way of adding the products up. A faster path that adds them in another order, or
in another layout, passes when it agrees with float32 on the next token almost everywhere and
is as sure of the text as float32 is.

- **Agreement**: teacher-forced, at each position of a fixed corpus, whether the candidate's
  top-1 next token is float32's.
- **Perplexity**: exp of the mean negative log-likelihood of the corpus's next tokens.

The corpus is split into documents (a line ``=====`` between two), each measured on its own from
its first token, so that no document needs more context than the model has.
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCUMENT_SEPARATOR = "\n=====\n"
# What the gate requires of a serving path against float32, with its margins stated (the
# default path on an AMD EPYC: docs/local-model.md):
# - every disagreement is a float32 near-tie: float32's own top token led the candidate's
#   choice by less than NEAR_TIE_LOGITS (the default path's largest lead among its
#   disagreements is 0.094, a fifth of it). A wrong layout or kernel makes decisive
#   disagreements, and one fails the gate whatever the agreement;
# - a top-1 agreement of at least MIN_AGREEMENT: 34 disagreements allowed on the corpus's
#   2,297 tokens, 22 seen, 12 to spare. Another CPU's kernels add the same products in
#   another order, which moves a logit by float32 rounding (a few 1e-4 at these magnitudes):
#   that can flip only a position whose float32 lead is about that small, and the corpus has
#   one under 0.001 (16 under 0.01), so rounding cannot use the spare up;
# - a perplexity within MAX_PERPLEXITY_RATIO of float32's (-0.12% seen, 1% allowed).
MIN_AGREEMENT = 0.985
MAX_PERPLEXITY_RATIO = 1.01
NEAR_TIE_LOGITS = 0.5
# A prefill chunk as the batch engine takes one beside running streams (LocalModel's
# prefill_chunk_tokens default): the candidate path runs the cache as serving does.
SERVING_CHUNK = 32


@dataclass(frozen=True)
class Measures:
    """A candidate path against float32 over one corpus."""

    tokens: int  # next-token predictions compared
    agreement: float
    perplexity: float
    reference_perplexity: float
    # Where the candidate's top token is not float32's: by how much float32 itself preferred
    # its own (its top logit minus its logit of the candidate's choice). Small values are
    # near-ties that any change of summation order may swap.
    disagreement_margins: tuple[float, ...] = ()

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity

    @property
    def decisive(self) -> int:
        """Disagreements that are no float32 near-tie (see NEAR_TIE_LOGITS)."""
        return sum(1 for margin in self.disagreement_margins if margin >= NEAR_TIE_LOGITS)

    @property
    def passes(self) -> bool:
        return (
            self.agreement >= MIN_AGREEMENT
            and abs(self.perplexity_ratio - 1.0) <= MAX_PERPLEXITY_RATIO - 1.0
            and self.decisive == 0
        )

    def describe(self) -> str:
        text = (
            f"{self.tokens} tokens: top-1 agreement {self.agreement:.2%} (at least "
            f"{MIN_AGREEMENT:.1%}), perplexity {self.perplexity:.4f} against float32's "
            f"{self.reference_perplexity:.4f} ({self.perplexity_ratio - 1:+.3%}, within "
            f"{MAX_PERPLEXITY_RATIO - 1:.0%})"
        )
        if self.disagreement_margins:
            text += (
                f"; {len(self.disagreement_margins)} disagreements, where float32's own top "
                f"token led by at most {max(self.disagreement_margins):.3f} logits "
                f"({self.decisive} of {NEAR_TIE_LOGITS} or more, none allowed)"
            )
        return text


def documents(text: str) -> list[str]:
    return [part.strip("\n") for part in text.split(DOCUMENT_SEPARATOR) if part.strip()]


def corpus_ids(tokenizer: Any, text: str) -> list[list[int]]:
    """Each document's token ids, without special tokens: the text as the model would read it
    in a completion prompt."""
    return [list(tokenizer(doc, add_special_tokens=False)["input_ids"]) for doc in documents(text)]


def reference_logits(model: Any, ids: Sequence[int]) -> Any:
    """float32 transformers, as ``generate`` computes a prompt: one forward pass over it all."""
    import torch

    with torch.inference_mode():
        output = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return output.logits[0].float()


def serving_logits(model: Any, ids: Sequence[int], chunk: int = SERVING_CHUNK) -> Any:
    """The serving path's numerics for the same tokens: the forward the batch engine calls, fed
    a chunk at a time through its cache, as a prompt is prefilled beside running streams."""
    import torch

    cache = None
    pieces = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            output = model(
                input_ids=torch.tensor([list(ids[start : start + chunk])], dtype=torch.long),
                cache=cache,
                use_cache=True,
            )
            cache = output.cache
            pieces.append(output.logits[0].float())
    return torch.cat(pieces)


def measure(
    reference: Callable[[Sequence[int]], Any],
    candidate: Callable[[Sequence[int]], Any],
    corpus: Sequence[Sequence[int]],
) -> Measures:
    """Agreement and perplexities of ``candidate`` against ``reference`` (each: token ids to
    their logits, one row per position) over the corpus's documents."""
    import torch

    agreed = compared = 0
    margins: list[float] = []
    nll_reference = nll_candidate = 0.0
    for ids in corpus:
        if len(ids) < 2:
            continue
        targets = torch.tensor(list(ids[1:]), dtype=torch.long)
        expected = reference(ids)[:-1]
        got = candidate(ids)[:-1]
        expected_top, got_top = expected.argmax(-1), got.argmax(-1)
        agreed += int((expected_top == got_top).sum())
        differ = (expected_top != got_top).nonzero().flatten()
        margins.extend(
            float(expected[index].max() - expected[index, got_top[index]]) for index in differ
        )
        compared += len(targets)
        nll_reference += _nll(expected, targets)
        nll_candidate += _nll(got, targets)
    if not compared:
        raise ValueError("the corpus has no document of two tokens or more")
    return Measures(
        tokens=compared,
        agreement=agreed / compared,
        perplexity=math.exp(nll_candidate / compared),
        reference_perplexity=math.exp(nll_reference / compared),
        disagreement_margins=tuple(margins),
    )


def _nll(logits: Any, targets: Any) -> float:
    import torch

    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return float(-logprobs.gather(1, targets[:, None]).sum())


def cpu_family() -> str:
    """This machine's CPU model as a file name: the golden answers' file is one per family
    (``amd-epyc``), since another CPU's kernels may round a near-tie the other way."""
    return re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-") or "unknown"


def machine_identity() -> dict[str, Any]:
    """What greedy float output depends on besides the code: the CPU (its kernels' paths), the
    threads (their split of each sum), and the numeric libraries' releases. A golden file is
    exact only where all of these match."""
    import torch
    import transformers

    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def cpu_model() -> str:
    """This machine's CPU model, as lscpu names it (its figures are this CPU's)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or os.uname().machine
