"""Reading a compact layer over its codes, under the model's own sdpa attention.

A compact layer's `update` returns two `CodedRead`s in place of its K/V tensors: tensors of the K/V's
shape, dtype and device that hold no data. The one operation they answer themselves is
`torch.nn.functional.scaled_dot_product_attention` (what transformers' "sdpa" attention calls), by
attending over the layer's codes (`CompactLayer.attend`: values never rebuilt, keys without a copy of
the layer); any other operation on them (eager attention, a wrapper that edits keys, a padded batch's
mask, printing) first rebuilds the layer's K/V once (`CompactLayer.read`) and runs on those. Nothing in
transformers is patched or wrapped: a DynamicCache, or any other cache, never meets a CodedRead.

The "varrate" attention implementation (`model.set_attn_implementation("varrate")`), registered when
hf_varrate is imported, is sdpa that takes a CodedRead before sdpa's own code does: it also reads the
codes for several queries under a mask (sdpa repeats the KV heads for those, a rebuild) and under a
softcap (which sdpa refuses). Every other cache gets sdpa, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "varrate"


class CodedRead(torch.Tensor):
    """A compact layer's keys (`part` 0) or values (`part` 1) [B, H, tokens, d], read through its codes.

    Made by `CodedRead.pair(layer)`; both halves share one rebuild, made only if an operation other than
    sdpa needs the data. `shape` is the K/V's (kvpress wraps every registered attention function when it
    is imported, and reads `key.shape`)."""

    layer: object
    part: int
    shared: dict

    @staticmethod
    def __new__(cls, layer, part: int, shared: dict, like: torch.Tensor, length: int):
        batch, heads, _, dim = like.shape
        read = torch.Tensor._make_wrapper_subclass(cls, (batch, heads, length, dim), dtype=like.dtype,
                                                   device=like.device, requires_grad=False)
        read.layer, read.part, read.shared = layer, part, shared
        return read

    def __init__(self, *args, **kwargs):
        super().__init__()

    @classmethod
    def pair(cls, layer) -> tuple[CodedRead, CodedRead]:
        """(keys, values) of `layer` as it is now: its appended tokens give dtype and device."""
        shared, length = {}, layer.get_seq_length()
        return cls(layer, 0, shared, layer.keys, length), cls(layer, 1, shared, layer.values, length)

    def materialize(self) -> torch.Tensor:
        """The rebuilt K/V this stands for (`CompactLayer.read`, once per pair; the tokens of the read's time)."""
        if "kv" not in self.shared:
            self.shared["kv"] = tuple(t[..., : self.shape[-2], :] for t in self.layer.read())
        return self.shared["kv"][self.part]

    def __repr__(self, **kwargs):
        return f"CodedRead(part={'keys' if self.part == 0 else 'values'}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = sdpa_over_codes(*args, **kwargs)
            if out is not None:
                return out
        elif func in _METADATA or getattr(func, "__name__", "") == "__get__":  # shape, dtype, device, ...
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_data, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_data, (args, kwargs or {}))
        return func(*args, **kwargs)


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
             torch.Tensor.is_floating_point, torch.Tensor.is_contiguous, torch.Tensor.get_device}


def _data(x):
    return x.materialize() if isinstance(x, CodedRead) else x


def sdpa_over_codes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """`F.scaled_dot_product_attention` over a compact layer's codes: [B, Hq, Q, d] as sdpa returns it, or
    None where the codes cannot be read as asked (the caller then rebuilds the K/V and runs sdpa).

    Read: one sequence, `key` and `value` one pair not yet rebuilt, no dropout, no causal flag (sdpa's is
    top-left aligned), a mask shared by the heads, and query heads a multiple of the KV heads (with or
    without `enable_gqa`; transformers packs one decoding query's heads as [B, H, rep, d])."""
    if not (isinstance(key, CodedRead) and isinstance(value, CodedRead) and key.shared is value.shared):
        return None
    if "kv" in key.shared:  # already rebuilt for another operation (which may have edited it: kvpress does)
        return None
    if type(query) is not torch.Tensor or dropout_p or is_causal or query.dim() != 4 or query.shape[0] != 1:
        return None
    if attn_mask is None and query.shape[-2] > 1:  # sdpa would let every query see every token
        return None
    if query.shape[1] % key.shape[1] or not key.layer.attends_codes(attn_mask):
        return None
    return key.layer.attend(query, attn_mask, query.shape[-1] ** -0.5 if scale is None else scale)


def varrate_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """An attention function with sdpa's signature and result ([B, Q, Hq, d], None): a CodedRead is read over
    its codes before sdpa would repeat its heads (several queries under a mask) or refuse a softcap."""
    if isinstance(key, CodedRead) and not dropout and key.layer.attends_codes(attention_mask):
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = key.layer.attend(query, attention_mask, scaling, softcap=kwargs.get("softcap"))
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(ATTENTION, varrate_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
