"""Evaluation only: the coded tokens' coefficients quantized per component instead of per token.

The codec quantizes each coded token's coefficients in groups of `coef_group` consecutive coefficients of
that token, each group with an fp16 min and step (`hf_varrate.codec.quantization`). On calibration text,
`studies.coefficient_bits` finds that a scale per component (over groups of `token_group` consecutive coded
tokens, KIVI's layout for keys) loses 20-25% less of the residual's energy at 0.1 on SmolLM2 for the same
bytes, and that bits chosen per component lose 25-45% less. Energy is a proxy; this asks whether answers
follow, without building a new code layout: a VarRate method spec with `eval_coefs: per_component` (3 bits,
`coef_bits`) or `per_component_best` (each component's bits 0-8 chosen on this prompt's own errors, a
Lagrangian sweep) codes the prompt with the library in materialized storage, then rewrites every coded
token's reconstruction from its anchor residual (the code's own anchors, neighbours and basis) quantized
the other way, with at most the bytes the codec's coefficients took. The footprint reported is the codec's
(the rewrite spends no more); the side information of `per_component_best` (a bit width per component,
one byte each) is left out, under 0.1% of a layer's codes. The rewrite's time is not counted: a library
layout would cost about what the codec's does. Round 9 chose `per_component` (docs/accuracy_dev.md); the
library's `coef_scales="component"` now codes it itself, with its own byte accounting (about the same rank).
"""

from __future__ import annotations

import torch

from hf_varrate.codec.anchors import gather_means
from hf_varrate.codec.joint import joint_rows
from hf_varrate.codec.packing import coef_bytes
from hf_varrate.codec.rope import rotate_heads

MODES = ("per_component", "per_component_best")
BITS = (0, 1, 2, 3, 4, 5, 6, 8)
SCALE_BYTES = 4  # a group's fp16 min and step


def column_blocks(coefs: torch.Tensor, token_group: int) -> torch.Tensor:
    """coefs [C, K] as [G, token_group, K] groups of consecutive rows, the last padded by repeating the last row
    (repeats add no new range or outlier); `.view(-1, K)[:C]` undoes it."""
    count, width = coefs.shape
    return torch.cat((coefs, coefs[-1:].expand(-count % token_group, width))).view(-1, token_group, width)


def quantize_columns(coefs: torch.Tensor, bits: int, token_group: int) -> torch.Tensor:
    """coefs [C, K] quantized and decoded per component over groups of `token_group` rows (min and step each)."""
    if bits == 0:
        return torch.zeros_like(coefs)
    count, width = coefs.shape
    blocks = column_blocks(coefs, token_group)
    lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    step = ((hi - lo) / (2**bits - 1)).clamp_min(1e-30)
    decoded = ((blocks - lo) / step).round_().clamp_(0, 2**bits - 1).mul_(step).add_(lo)
    return decoded.view(-1, width)[:count]


def column_errors(coefs: torch.Tensor, token_group: int) -> torch.Tensor:
    """[len(BITS), K] the energy each component loses at each bit width."""
    return torch.stack([(coefs - quantize_columns(coefs, bits, token_group)).square().sum(0) for bits in BITS])


def column_bytes(count: int, token_group: int) -> torch.Tensor:
    """[len(BITS)] bytes one component of `count` rows takes at each bit width (codes, its groups' min and step)."""
    groups = -(-count // token_group)
    return torch.tensor([0.0 if b == 0 else count * b / 8 + SCALE_BYTES * groups for b in BITS])


def best_bits(errors: torch.Tensor, cost: torch.Tensor, spend: float) -> torch.Tensor:
    """[K] indices into BITS: the least total error whose bytes fit `spend` (a Lagrangian sweep)."""
    best, pick = float(errors[0].sum()), torch.zeros(errors.shape[1], dtype=torch.long)
    for lam in torch.logspace(-8, 4, 600).tolist():
        choice = (errors + lam * cost[:, None]).argmin(0)
        if float(cost[choice].sum()) <= spend:
            lost = float(errors.gather(0, choice[None])[0].sum())
            if lost < best:
                best, pick = lost, choice
    return pick


def fixed_rank(count: int, bits: int, token_group: int, spend: float, width: int) -> int:
    """The most leading components at `bits` bits each that `spend` bytes hold."""
    return min(int(spend // float(column_bytes(count, token_group)[BITS.index(bits)])), width)


def recoded(coefs: torch.Tensor, mode: str, bits: int, token_group: int, spend: float) -> torch.Tensor:
    """coefs [C, R] as the other quantizer returns them, in at most `spend` bytes."""
    if mode == "per_component":
        rank = fixed_rank(coefs.shape[0], bits, token_group, spend, coefs.shape[1])
        out = torch.zeros_like(coefs)
        out[:, :rank] = quantize_columns(coefs[:, :rank], bits, token_group)
        return out
    pick = best_bits(column_errors(coefs, token_group), column_bytes(coefs.shape[0], token_group), spend)
    out = torch.zeros_like(coefs)
    for i, b in enumerate(BITS):
        columns = (pick == i).nonzero()[:, 0]
        if b and columns.numel():
            out[:, columns] = quantize_columns(coefs[:, columns], b, token_group)
    return out


def rewrite(cache, captured, bases, config, mode: str, token_group: int = 64) -> dict:
    """Rewrite each materialized layer's coded tokens (see the module docstring); returns diagnostics."""
    if mode not in MODES:
        raise ValueError(f"eval_coefs={mode!r}: choose one of {MODES}")
    if config.storage != "materialized" or config.coef_bits is None:
        raise ValueError("eval_coefs needs storage='materialized' and coef_bits set (the codec's bytes to match)")
    kept = []
    for i, layer in enumerate(cache.layers):
        for code in getattr(layer, "codes", [])[:1]:
            if code.stored_exactly or code.ranks.numel() == 0:
                continue
            kept.append(_rewrite_layer(layer, code, captured, i, bases, config, mode, token_group))
    return {"eval_coefs": mode, "eval_rank_ratio": round(sum(kept) / len(kept), 3) if kept else None}


def _rewrite_layer(layer, code, captured, i, bases, config, mode, token_group) -> float:
    """Rewrite one layer; returns the components kept with any bits over the codec's mean rank."""
    keys, values, cos, sin = captured.keys[i], captured.values[i], captured.cos[i], captured.sin[i]
    basis, scales = bases.coding_basis(i, config.balance, keys.device, key_weight=config.key_weight,
                                       bits=config.basis_bits)
    basis = basis.float()
    coded, anchors = code.coded_pos.long(), code.anchor_pos.long()
    z, z_anchors = (joint_rows(keys, values, cos, sin, p) for p in (coded, anchors))
    if scales is not None:
        z, z_anchors = z.mul_(scales), z_anchors.mul_(scales)
    means = gather_means(z_anchors, code.neighbours.long())
    coefs = (z - means) @ basis.T  # [C, R]
    quantized = recoded(coefs, mode, config.coef_bits, token_group, coef_bytes(code.coefs))
    z_hat = quantized @ basis + means
    if scales is not None:
        z_hat.div_(scales)
    heads, dim = keys.shape[1], keys.shape[-1]
    half = heads * dim
    planes = z_hat[:, :half].reshape(-1, heads, dim).transpose(0, 1).contiguous()  # [H, C, d]
    rotate_heads(planes, cos[0].index_select(0, coded).float(), sin[0].index_select(0, coded).float())
    layer.keys[0].index_copy_(1, coded, planes.to(layer.keys.dtype))
    layer.values[0].index_copy_(1, coded,
                                z_hat[:, half:].reshape(-1, heads, dim).transpose(0, 1).to(layer.values.dtype))
    return float((quantized != 0).any(0).sum()) / float(code.ranks.float().mean())
