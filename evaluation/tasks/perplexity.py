"""Perplexity on held-out Wikipedia extracts (the paper's Appendix A.1, on our models' data).

Articles come from hf_varrate's fixed held-out split (`hf_varrate.calibration.texts`: 1 article in
10 by a hash of its title, never used to calibrate the shipped bases). They are packed into
sequences of `length` context tokens + `eval_tokens` continuation tokens. The context is compressed
(there is no question: the regime is query-agnostic by construction); the continuation is fed
through the compressed cache in one forward and scored: NLL of its tokens 2..m (token 1's
prediction comes from the prefill itself, which every method computes exactly).
"""

from __future__ import annotations

from ..prompts import Segments
from .base import Example


def perplexity_examples(task: str, tokenizer, chat: bool, length: int, n: int, *, eval_tokens: int = 256,
                        seed: int = 0, **_) -> list[Example]:
    from hf_varrate.calibration.contexts import build_contexts
    from hf_varrate.calibration.texts import load_texts

    documents = load_texts(None, split="held_out", seed=seed).documents
    contexts = build_contexts(tokenizer, documents, n, length + eval_tokens)
    examples = []
    for i, ids in enumerate(contexts):
        ids = ids.tolist()
        segments = Segments(ids[:length], [], ids[length:])
        examples.append(Example(task, f"{task}-L{length}-{i:03d}", segments, [], "nll", 0,
                                {"length": length, "tokens": length, "eval_tokens": eval_tokens}))
    return examples
