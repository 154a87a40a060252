"""Calibration contexts: documents packed into token sequences of a fixed length.

Each context starts with the tokens the tokenizer puts in front of any text (BOS for Gemma, none
for SmolLM2), then whole documents joined by a blank line until the length is reached; the rest
of the last document is dropped, so the next context starts at a document boundary. Documents are
read one at a time, as needed (a streamed source is never read further than the contexts need), at most
`max_tokens` tokens of them, under a tqdm bar counting the tokens read.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

SEPARATOR = "\n\n"


def build_contexts(tokenizer, documents: Iterable[str], num_contexts: int, context_length: int, *,
                   max_tokens: int | None = None, progress: bool = False) -> list[torch.Tensor]:
    """`num_contexts` LongTensors [context_length] from `documents`, in order, reading at most
    `max_tokens` tokens of text (None: as many as the contexts need)."""
    if num_contexts < 1 or context_length < 2:
        raise ValueError(f"need num_contexts >= 1 and context_length >= 2, got {num_contexts} and {context_length}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive number of tokens or None, got {max_tokens}")
    prefix = special_prefix(tokenizer)
    body = context_length - len(prefix)
    contexts: list[torch.Tensor] = []
    current: list[int] = []
    read = 0
    with tqdm(total=max_tokens, desc="reading text", unit="token", unit_scale=True, disable=not progress) as bar:
        for document in documents:
            ids = tokenizer(document + SEPARATOR, add_special_tokens=False)["input_ids"]
            ids = ids if max_tokens is None else ids[: max_tokens - read]
            read += len(ids)
            bar.update(len(ids))
            current.extend(ids)
            if len(current) >= body:
                contexts.append(torch.tensor(prefix + current[:body], dtype=torch.long))
                current = []
                if len(contexts) == num_contexts:
                    return contexts
            if max_tokens is not None and read >= max_tokens:
                break
    stopped = max_tokens is not None and read >= max_tokens
    limit = f" (stopped at max_tokens={max_tokens}: raise --max-tokens)" if stopped else ""
    raise ValueError(
        f"the calibration text holds only {len(contexts)} contexts of {context_length} tokens, {num_contexts} "
        f"asked{limit}; give more text, or lower --num-contexts or --context-length"
    )


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer adds in front of a text (e.g. [BOS]), read off an example."""
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("Hello", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []
