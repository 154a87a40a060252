"""Evaluation only: keys quantized per channel (KIVI's layout) beside values coded low-rank (a hypothesis).

The codec codes each token's keys and values jointly, one rank for both. On Gemma-3 the answers ride on the keys
of whole needle sentences and the values are over-served (docs/accuracy_dev.md, the diagnostic); the issue's list
names "keys quantized per channel beside low-rank values" as a way to move bytes from values to keys that the key
weight does not cover: a per-channel quantizer spends the same few bits on every key channel of every token, where
a rank keeps only the directions that carry the calibration text's energy.

A VarRate method spec with `eval_keys_bits: b` (and `eval_keys_group: G`, default 64) codes the prompt with the
library in materialized storage at a `key_weight` small enough that the joint PCA serves the values (the spec sets
it, e.g. 0.01), then replaces every coded token's key by its pre-RoPE key quantized per channel: each channel of
each KV head over groups of G consecutive coded tokens, an fp16 min and step per group (KIVI quantizes keys per
channel, KVQuant before RoPE), re-rotated at the token's position. Exact tokens (anchors, window, sinks) keep
their exact keys. The spec's `budget` is the total: the codec runs at the budget less what the quantized keys take,
the first pass assuming every token coded, a second pass spending what the exact tokens left. Reported bytes are
the codec's plus the quantized keys' (codes at b bits, 4 bytes of scales per group and channel); both passes'
time is counted, the second pass only where the first left more than 0.2% of the budget.
"""

from __future__ import annotations

import math

import torch

from hf_varrate.codec.rope import rotate_heads, unrotate_rows

from .component_bits import SCALE_BYTES, quantize_columns


def quantize_channels(keys: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """keys [C, W] (C tokens, W channels) quantized and decoded per channel over groups of `group` consecutive
    rows, a min and step each, a partial last group as if alone (`component_bits.quantize_columns`)."""
    if bits < 1 or bits > 8:
        raise ValueError(f"eval_keys_bits={bits!r}: must be an integer in 1..8")
    return quantize_columns(keys, bits, group)


def key_bytes(count: int, channels: int, bits: int, group: int) -> int:
    """Bytes `count` tokens' keys of `channels` channels take: codes at `bits` bits, scales per group and channel."""
    return math.ceil(count * channels * bits / 8) + SCALE_BYTES * channels * math.ceil(count / group)


def share(bits: int, group: int) -> float:
    """The fraction of fp16 K/V bytes the quantized keys take if every token is coded (the first pass's guess)."""
    return (bits / 8 + SCALE_BYTES / group) / 4  # per key element, over a key and a value element at 2 bytes


def rewrite_keys(cache, captured, bits: int, group: int) -> dict[int, int]:
    """Replace each materialized layer's coded keys by their per-channel quantization; returns {layer: key bytes}."""
    spent = {}
    for i, layer in enumerate(cache.layers):
        codes = getattr(layer, "codes", [])
        if not codes:
            continue
        if len(codes) > 1:
            raise ValueError("eval_keys_bits rewrites one coded prompt per layer; this cache holds several")
        code = codes[0]
        if code.stored_exactly or code.coded_pos.numel() == 0:
            spent[i] = 0
            continue
        keys, cos, sin = captured.keys[i], captured.cos[i], captured.sin[i]
        coded = code.coded_pos.long()
        heads, dim = keys.shape[1], keys.shape[-1]
        c, s = cos[0].index_select(0, coded).float(), sin[0].index_select(0, coded).float()
        raw = unrotate_rows(keys[0].transpose(0, 1).index_select(0, coded), c, s)  # [C, H, d] pre-RoPE fp32
        quantized = quantize_channels(raw.reshape(coded.numel(), heads * dim), bits, group)
        planes = quantized.view(-1, heads, dim).transpose(0, 1).contiguous()  # [H, C, d]
        rotate_heads(planes, c, s)
        layer.keys[0].index_copy_(1, coded, planes.to(layer.keys.dtype))
        spent[i] = key_bytes(coded.numel(), heads * dim, bits, group)
    return spent

