"""Would spending the coefficient bytes differently code the residuals better? `python -m studies.coefficient_bits`.

The codec keeps each coded token's first r_t PCA coefficients of its anchor residual and quantizes them in
groups of `coef_group` consecutive coefficients of one token, each group with its own fp16 min and step
(`codec.quantization`). Transform coding suggests two other ways to spend the same bytes: a scale per
component (per channel, over groups of tokens, KIVI's layout for keys) so that a small trailing component
is not quantized with the step of a large leading one, and bits that fall with the component's variance
(reverse water-filling), so that more components fit. This measures, on one held-out calibration context,
how much of each layer's coded residual energy each way loses at the coefficient bytes per coded token
that budgets 0.1 and 0.2 (counted in fp16, the `recommended` preset's exact set and side information taken
off) leave:

- `per token`: what the codec does, at its 3 and 4 bits, the largest rank that fits;
- `per component, 3-bit`: the same ranks' worth of bytes, each component quantized over groups of
  `--token-group` tokens with its own min and step;
- `Gaussian / fitted levels`: the same rank and side bytes with 8 non-uniform levels (the Lloyd-Max ones of a
  Gaussian, or fitted to the layer's own normalized coefficients) at each group's mean and deviation, as a
  ratio of the lost energy to min and step's;
- `per component, best bits`: each component's bits (0-8) chosen by a Lagrangian sweep over the measured
  error of every (component, bits) pair, the best any per-component uniform quantizer of this layout reaches.

A proxy, not a result: residual energy in the coding space, not answers. The number to read is the ratio of
the lost energy between the ways at equal bytes; the last column divides by what the preset does (3 bits at 0.1,
4 at 0.2). Per-layer budgets (`layer_budgets="measured"` at 0.1) are left out: every layer gets the uniform bytes.
`evaluation/methods/component_bits.py` (`eval_coefs`) asks whether answers follow.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate import Bases
from hf_varrate.codec.anchors import anchor_positions, exact_mask, gather_means, nearest_anchors_mm
from hf_varrate.codec.joint import joint_rows
from hf_varrate.codec.packing import meta_bytes_per_token
from hf_varrate.codec.pipeline import effective_stride
from hf_varrate.codec.quantization import dequantize, quantize
from hf_varrate.models import DEFAULT_MODELS
from hf_varrate.shipped import SHIPPED_ROOT

from evaluation.capture import capture, full_attention_layers
from evaluation.methods.component_bits import column_blocks, fixed_rank, recoded

from studies._context import held_out_context

SCALE_BYTES = 4  # a group's fp16 min and step


def residual_coefficients(captured, layer: int, bases: Bases, config) -> torch.Tensor:
    """[C, D] the coded tokens' anchor residuals in the layer's coding basis (the coefficients the codec truncates)."""
    keys, values = captured.keys[layer], captured.values[layer]
    seq_len = keys.shape[-2]
    stride = effective_stride(config, seq_len)
    basis, scales = bases.coding_basis(layer, config.balance, key_weight=config.key_weight, bits=None)[:2]
    coded = (~exact_mask(seq_len, stride, config.window)).nonzero()[:, 0]
    anchors = anchor_positions(seq_len, stride)
    rows = [joint_rows(keys, values, captured.cos[layer], captured.sin[layer], p) for p in (coded, anchors)]
    z, z_anchors = (r if scales is None else r.mul_(scales) for r in rows)
    residual = z - gather_means(z_anchors, nearest_anchors_mm(z, z_anchors, config.n_anchors, config.distance_chunk))
    return residual @ basis.float().T


def bytes_per_token(config, budget: float, seq_len: int, width: int, rank: int) -> float:
    """Coefficient bytes per coded token that `budget` (fp16-counted) leaves after the exact set and side
    information."""
    stride = effective_stride(config.replace(budget=budget), seq_len)
    n_exact = int(exact_mask(seq_len, stride, config.window).sum())
    n_coded = seq_len - n_exact
    meta = meta_bytes_per_token(config.n_anchors, anchor_positions(seq_len, stride).numel(), rank)
    return (budget * seq_len * width * 2 - n_exact * width * 2 - n_coded * meta) / n_coded


def per_token_loss(coefs: torch.Tensor, bits: int, group: int, spend: float) -> tuple[float, int]:
    """(energy lost, rank) of the codec's layout at the largest rank whose bytes per token fit `spend`."""
    count, width = coefs.shape
    rank = 0
    for r in range(1, width + 1):
        if (r * bits / 8 + SCALE_BYTES * -(-r // group)) > spend:
            break
        rank = r
    if rank == 0:
        return float(coefs.square().sum()), 0
    ranks = torch.full((count,), rank, dtype=torch.long)
    kept = coefs[:, :rank].contiguous()
    decoded = dequantize(quantize(kept.reshape(-1), ranks, bits, group), ranks).view(count, rank)
    return float((kept - decoded).square().sum() + coefs[:, rank:].square().sum()), rank


# The 8 reconstruction levels of the Lloyd-Max quantizer of a unit Gaussian (Max 1960), MSE 0.0345 against a uniform
# quantizer's 0.0374 at its best step
GAUSSIAN_LEVELS = (-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152)


def leveled_columns(coefs: torch.Tensor, token_group: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """coefs [C, K] quantized per component over groups of `token_group` rows like `quantize_columns`, with the
    same side information (a mean and a standard deviation instead of a min and step) and 8 non-uniform levels:
    the Gaussian Lloyd-Max ones, or `levels` given in units of the group's deviation."""
    levels = torch.tensor(GAUSSIAN_LEVELS) if levels is None else levels
    count, width = coefs.shape
    unit, mean, std = _unit_blocks(column_blocks(coefs, token_group))
    decoded = levels[(unit[..., None] - levels).abs().argmin(-1)] * std + mean
    return decoded.view(-1, width)[:count]


def fitted_levels(coefs: torch.Tensor, token_group: int, rounds: int = 30) -> torch.Tensor:
    """8 levels fitted by Lloyd's algorithm to this layer's own group-normalized coefficients (one codebook for
    the layer, fitted on the data it then codes: an optimistic bound on any level shape)."""
    count, width = coefs.shape
    blocks = coefs[: count - count % token_group].reshape(-1, token_group, width)
    unit = _unit_blocks(blocks)[0].reshape(-1)
    levels = torch.tensor(GAUSSIAN_LEVELS)
    for _ in range(rounds):
        cell = (unit[:, None] - levels).abs().argmin(1)
        levels = torch.stack([unit[cell == i].mean() if (cell == i).any() else levels[i] for i in range(8)])
    return levels


def _unit_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks [G, T, K] in units of each group's deviation about its mean, the means, the deviations)."""
    mean, std = blocks.mean(1, keepdim=True), blocks.std(1, keepdim=True).clamp_min(1e-30)
    return (blocks - mean) / std, mean, std


def loss(coefs: torch.Tensor, quantized: torch.Tensor) -> float:
    return float((coefs - quantized).square().sum())


def held_out_capture(model_name: str, length: int, n_layers: int):
    """(shipped bases, capture of one held-out wiki context of `length` tokens, `n_layers` full-attention layers
    evenly spread): what the coefficient studies measure on."""
    model, _, ids = held_out_context(model_name, length)
    bases = Bases.from_pretrained(str(SHIPPED_ROOT / model_name))
    captured = capture(model, ids[0].tolist())
    layers = full_attention_layers(model)
    return bases, captured, layers[:: max(1, -(-len(layers) // n_layers))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budgets", default="0.1,0.2")
    parser.add_argument("--token-group", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6, help="full-attention layers, evenly spread")
    args = parser.parse_args(argv)
    bases, captured, layers = held_out_capture(args.model, args.length, args.layers)
    print(f"# {args.model}, one held-out wiki context of {args.length} tokens; energy of the coded residual lost "
          f"(share), per token (the codec) against per component (groups of {args.token_group} tokens)\n")
    print("| budget | layer | bytes / coded token | per token 3-bit (rank) | per token 4-bit (rank) | "
          "per component 3-bit | the same with Gaussian / fitted levels, vs min and step | per component, best bits | "
          "best bits vs the preset's code |")
    print("|---|---|---|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        config = bases.config("recommended", budget=budget, budget_dtype="float16")
        for layer in layers:
            coefs = residual_coefficients(captured, layer, bases, config)
            total = float(coefs.square().sum())
            spend = bytes_per_token(config, budget, args.length, coefs.shape[1], coefs.shape[1])
            (lost3, r3), (lost4, r4) = (per_token_loss(coefs, b, config.coef_group, spend) for b in (3, 4))
            col3, best = (loss(coefs, recoded(coefs, mode, 3, args.token_group, spend * coefs.shape[0]))
                          for mode in ("per_component", "per_component_best"))
            rank = fixed_rank(coefs.shape[0], 3, args.token_group, spend * coefs.shape[0], coefs.shape[1])
            head, tail = coefs[:, :rank], float(coefs[:, rank:].square().sum())
            gaussian, fitted = (loss(head, leveled_columns(head, args.token_group, levels)) + tail
                                for levels in (None, fitted_levels(head, args.token_group)))
            print(f"| {budget} | {layer} | {spend:.1f} | {lost3 / total:.3f} ({r3}) | {lost4 / total:.3f} ({r4}) | "
                  f"{col3 / total:.3f} | {gaussian / col3:.3f} / {fitted / col3:.3f} | {best / total:.3f} | "
                  f"{best / (lost3 if config.coef_bits == 3 else lost4):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
