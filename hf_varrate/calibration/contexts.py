"""Calibration contexts: documents packed into token sequences of a fixed length.

Each context starts with the tokens the tokenizer puts in front of any text (BOS for Gemma, none
for SmolLM2), then whole documents joined by a blank line until the length is reached; the rest
of the last document is dropped, so the next context starts at a document boundary.
"""

from __future__ import annotations

import torch

SEPARATOR = "\n\n"


def build_contexts(tokenizer, documents: list[str], num_contexts: int, context_length: int) -> list[torch.Tensor]:
    """`num_contexts` LongTensors [context_length] from `documents`, in order."""
    if num_contexts < 1 or context_length < 2:
        raise ValueError(f"need num_contexts >= 1 and context_length >= 2, got {num_contexts} and {context_length}")
    prefix = special_prefix(tokenizer)
    body = context_length - len(prefix)
    contexts: list[torch.Tensor] = []
    current: list[int] = []
    for document in documents:
        current.extend(tokenizer(document + SEPARATOR, add_special_tokens=False)["input_ids"])
        if len(current) >= body:
            contexts.append(torch.tensor(prefix + current[:body], dtype=torch.long))
            current = []
            if len(contexts) == num_contexts:
                return contexts
    raise ValueError(
        f"the calibration text holds only {len(contexts)} contexts of {context_length} tokens, {num_contexts} "
        f"asked; give more text, or lower --num-contexts or --context-length"
    )


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer adds in front of a text (e.g. [BOS]), read off an example."""
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("Hello", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []
