"""What a task hands the runner: examples with their prompt segments, answers and metric."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from ..prompts import Segments


@dataclass
class Example:
    """One evaluation item. `metric`: 'all' (every answer must appear: RULER niah), 'part' (any answer:
    RULER qa) or 'nll' (perplexity: `segments.tail` is the continuation to score)."""

    task: str
    example_id: str
    segments: Segments
    answers: list[str]
    metric: str
    max_new_tokens: int
    meta: dict = field(default_factory=dict)  # target length, depth, ...


def example_rng(*parts) -> random.Random:
    """A generator seeded from the example's identity, so examples never depend on run order."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()
    return random.Random(int(digest[:16], 16))


def score(metric: str, prediction: str, answers: list[str]) -> float:
    """RULER's string_match_all / string_match_part per sample, as a fraction in [0, 1]."""
    pred = prediction.lower()
    hits = [answer.lower() in pred for answer in answers]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "part":
        return float(any(hits))
    raise ValueError(f"metric must be 'all' or 'part' for generated answers, got {metric!r}")
