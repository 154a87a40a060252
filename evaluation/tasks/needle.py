"""RULER needle-in-a-haystack (niah_single_2 and niah_multikey_1) in the Paul Graham essays.

Needles are RULER's "One of the special magic numbers for {key} is: {value}." with adjective-noun
keys and 7-digit values; the haystack is essay text cut to the target token length; needles are
inserted at sentence boundaries at their depths. Single: one needle at a depth from `depths`
(cycled, so depth x length cells are balanced). Multi-key: `num_keys` needles with distinct keys at
random depths, one of them asked (RULER's multikey_1: the others are distractors).
"""

from __future__ import annotations

import re

from ..prompts import encode, overhead_tokens, segment_ids
from .base import Example, example_rng

CONTEXT = ("A special magic number is hidden within the following text. Make sure to memorize it. "
           "I will quiz you about the number afterwards.\n{context}\n")
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
ADJECTIVES = ("abundant", "brave", "calm", "damp", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "mellow", "noisy", "odd", "plain", "quick", "rapid", "shiny", "tidy", "upbeat", "vivid",
              "wary", "young", "zesty", "bitter", "cheerful", "dusty", "fragile", "glossy")
NOUNS = ("tiger", "anchor", "blanket", "canyon", "dolphin", "engine", "falcon", "garden", "harbor", "island",
         "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle",
         "tunnel", "umbrella", "violin", "walnut", "yacht", "zebra", "basket", "cactus", "feather", "glacier")
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def depth_bin(depth: float, bins: int) -> int:
    """Which of `bins` equal spans of the document a needle at `depth` (a fraction of it) sits in; 1 is the last."""
    return min(int(depth * bins), bins - 1)


def needle_examples(task: str, tokenizer, chat: bool, length: int, n: int, *, num_keys: int = 1,
                    depths=DEFAULT_DEPTHS, max_new_tokens: int = 16, first: int = 0, **_) -> list[Example]:
    """`n` examples whose compressed context (query-agnostic) is about `length` tokens: numbers
    `first` .. `first + n - 1` (a disjoint `first` gives a disjoint split, e.g. development vs held-out)."""
    from hf_varrate.demo import essay_text

    essay = re.sub(r"\s+", " ", essay_text())
    body = length - overhead_tokens(tokenizer, chat, CONTEXT)
    return [_example(task, tokenizer, chat, essay, length, body, i, num_keys, tuple(depths), max_new_tokens)
            for i in range(first, first + n)]


def _example(task, tokenizer, chat, essay, length, body, i, num_keys, depths, max_new_tokens) -> Example:
    rng = example_rng(task, length, i)
    keys = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], num_keys)
    values = [str(rng.randint(10**6, 10**7 - 1)) for _ in keys]
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    if num_keys == 1:
        placed = [depths[i % len(depths)]]
    else:
        placed = [round(rng.uniform(0.05, 0.95), 3) for _ in keys]
    budget = body - sum(len(encode(tokenizer, " " + needle)) for needle in needles)
    text = _insert(_haystack(tokenizer, essay, budget, rng), needles, placed)
    asked = rng.randrange(num_keys)
    segments = segment_ids(tokenizer, chat, CONTEXT.format(context=text), QUESTION.format(key=keys[asked]),
                           ANSWER_PREFIX.format(key=keys[asked]))
    meta = {"length": length, "depth": placed[asked], "num_keys": num_keys, "tokens": len(segments.context)}
    return Example(task, f"{task}-L{length}-{i:03d}", segments, [values[asked]], "all", max_new_tokens, meta)


def _haystack(tokenizer, essay: str, n_tokens: int, rng) -> str:
    """About `n_tokens` tokens of essay text starting at a sentence, from a seeded offset."""
    start = rng.randrange(0, len(essay) - n_tokens * 8)
    start = essay.find(". ", start) + 2
    ids = encode(tokenizer, essay[start : start + n_tokens * 8])[:n_tokens]
    return tokenizer.decode(ids).strip()


def _insert(text: str, needles: list[str], depths: list[float]) -> str:
    """Insert each needle at the sentence boundary nearest its depth (deepest first keeps offsets valid)."""
    for needle, depth in sorted(zip(needles, depths), key=lambda nd: -nd[1]):
        cut = text.rfind(". ", 0, max(int(len(text) * depth), 1)) + 2 if depth > 0 else 0
        cut = 0 if cut < 2 else cut
        text = text[:cut] + needle + " " + text[cut:]
    return text
