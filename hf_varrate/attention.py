"""The "varrate" attention implementation: transformers' sdpa attention, except on a compact VarRate
layer, where it attends over the layer's codes (`codec.attend_codes`) instead of rebuilding the
layer's K/V at every read.

    model.set_attn_implementation("varrate")   # or from_pretrained(..., attn_implementation="varrate")

Importing hf_varrate registers the name (and sdpa's mask for it); a model that does not ask for it
is unaffected. Under it, a compact layer's `update` returns a `CodedRead` in place of K/V tensors, and
only `varrate_attention` reads one; any other layer or cache gets sdpa, unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "varrate"


class CodedRead:
    """A compact VarRateLayer standing in for its K/V: `varrate_attention` attends over its codes.

    `shape` is the K/V's, [B, H, tokens, d], for wrappers that look at it on the way (kvpress wraps every
    registered attention function when it is imported, and reads `key.shape`)."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer

    @property
    def shape(self) -> torch.Size:
        batch, heads, _, dim = self.layer.keys.shape
        return torch.Size((batch, heads, self.layer.get_seq_length(), dim))


def varrate_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """An attention function with sdpa's signature and result ([B, Q, Hq, d], None)."""
    if not isinstance(key, CodedRead):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = key.layer
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dropout or not layer.attends_codes(attention_mask):
        keys, values = layer.read()
        return sdpa_attention_forward(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return layer.attend(query, attention_mask, scaling, softcap=kwargs.get("softcap")), None


AttentionInterface.register(ATTENTION, varrate_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
