"""What a method is to the runner: build a compressed cache from a capture, in a measured time."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..capture import Captured


@dataclass
class Context:
    """Everything a method may read to compress one prompt."""

    model: torch.nn.Module
    tokenizer: object
    model_name: str
    captured: Captured  # already cut to the compressed prompt
    ids: list[int]  # the compressed prompt's token ids


@dataclass
class Compressed:
    cache: object
    seconds: float  # compression work beyond the plain prefill
    masks: dict | None = None  # layer -> masked_key_indices (kvpress's masked eviction)
    extra: dict = field(default_factory=dict)  # method-specific diagnostics for the JSONL row


class Unsupported(RuntimeError):
    """This method cannot run on this model (e.g. kvpress's KVzip refuses Gemma-3)."""


def dynamic_from_capture(model, captured: Captured) -> DynamicCache:
    """The model's own uncompressed cache for the captured prompt (sliding layers as the model keeps them)."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(captured.keys, captured.values)):
        cache.update(k, v, i)
    return cache
