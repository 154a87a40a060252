"""What the studies that measure one prompt start from: a default model and one held-out wiki context."""

from __future__ import annotations

import torch

from hf_varrate.calibration.contexts import build_contexts
from hf_varrate.calibration.texts import wiki_documents
from hf_varrate.models import load_default_model


def held_out_context(model_name: str, length: int):
    """(model, tokenizer, ids [1, length]): the default model `model_name`, gradients off, and one held-out wiki
    context of `length` tokens (never calibrated on)."""
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(model_name)
    ids = build_contexts(tokenizer, wiki_documents("held_out"), 1, length)[0].view(1, -1)
    return model, tokenizer, ids
