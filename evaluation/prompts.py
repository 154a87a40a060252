"""Prompt segments, tokenized separately so every regime sees the same token ids.

An example is three segments: the context A (always compressed), the question Q and the tail T
(template suffix + answer prefix). Query-agnostic: compress A, then feed Q+T. Query-aware:
compress A+Q, then feed T. This is kvpress's split (`pipeline.py`: context vs question ids).
Chat models get their chat template (A = template head + context, T = template suffix + answer
prefix); plain models get BOS + context and "\\n" + answer prefix, as kvpress does.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER = "\u2063SPLIT\u2063"


@dataclass
class Segments:
    context: list[int]
    question: list[int]
    tail: list[int]

    def compressed(self, regime: str) -> list[int]:
        return self.context + self.question if regime == "query_aware" else self.context

    def fed_after(self, regime: str) -> list[int]:
        return self.tail if regime == "query_aware" else self.question + self.tail


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def segment_ids(tokenizer, chat: bool, context: str, question: str, answer_prefix: str) -> Segments:
    """Token ids of (A, Q, T) for a chat-template model (`chat`) or a plain completion model."""
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + MARKER}], tokenize=False,
                                                 add_generation_prompt=True)
        head, suffix = rendered.split(MARKER)
        return Segments(encode(tokenizer, head), encode(tokenizer, question), encode(tokenizer, suffix + answer_prefix))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return Segments(bos + encode(tokenizer, context), encode(tokenizer, question),
                    encode(tokenizer, "\n" + answer_prefix))


def overhead_tokens(tokenizer, chat: bool, template_context: str) -> int:
    """Tokens the template adds around an empty document (to size the haystack to a target length)."""
    return len(segment_ids(tokenizer, chat, template_context.format(context=""), "", "").context)
