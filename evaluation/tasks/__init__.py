"""Task registry: a task name -> (builder, default options)."""

from __future__ import annotations

from .base import Example, score
from .needle import needle_examples
from .perplexity import perplexity_examples
from .qa import qa_examples

TASKS = {
    "niah_single": (needle_examples, {"num_keys": 1}),
    "niah_multikey": (needle_examples, {"num_keys": 4}),
    "qa_squad": (qa_examples, {"dataset": "squad"}),
    "qa_hotpotqa": (qa_examples, {"dataset": "hotpotqa"}),
    "ppl_wiki": (perplexity_examples, {}),
}


def build_examples(task: str, tokenizer, chat: bool, length: int, n: int, **options) -> list[Example]:
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    builder, defaults = TASKS[task]
    return builder(task, tokenizer, chat, length, n, **{**defaults, **options})


__all__ = ["Example", "TASKS", "build_examples", "score"]
