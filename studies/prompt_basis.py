"""Would a basis of the prompt's own, stored beside its codes, code it better? `python -m studies.prompt_basis`.

The codec projects each coded token's anchor residual on the layer's shipped PCA basis, calibrated once on
wiki text. A basis fitted to the prompt itself (the PCA of its own coded residuals) captures more of their
energy in the same rank, but it is the prompt's: the decoder needs it, so it is stored with the codes and
its bytes come out of the same budget. This measures, on one held-out calibration context, per layer, the
share of the coded residual's energy each way loses at the coefficient bytes per coded token the budget
leaves (`coefficient_bits.bytes_per_token`; the `recommended` preset, fp16-counted):

- `shipped`: the codec's code, the preset's quantizer (per token, or per component where the preset
  sets `coef_scales="component"`) at the largest rank that fits;
- `own basis, charged`: the prompt's own leading components, as many as minimize the loss once their rows
  (8 bits per entry, as `basis_bits=8` stores the shipped ones) are paid from the coded tokens' bytes;
- `own basis, free`: the same with the rows not paid for, an upper bound no decoder reaches.

A proxy, not a result: residual energy in the coding space, not answers (round 9 in docs/accuracy_dev.md
found 20-25% less energy did not reliably move answers). The number to read is the last line per budget:
the charged loss over the shipped one, averaged over the layers shown.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate.models import DEFAULT_MODELS

from evaluation.methods.component_bits import recoded

from .coefficient_bits import bytes_per_token, held_out_capture, per_token_loss, residual_coefficients

BASIS_BYTES = 1  # per basis entry, as the shipped bases are stored (basis_bits=8)


def preset_loss(coefs: torch.Tensor, config, spend: float, token_group: int) -> float:
    """Energy of coefs [C, K] the preset's quantizer loses at `spend` bytes per coded token."""
    if config.coef_scales == "component":
        kept = recoded(coefs, "per_component", config.coef_bits, token_group, spend * coefs.shape[0])
        return float((coefs - kept).square().sum())
    return per_token_loss(coefs, config.coef_bits, config.coef_group, spend)[0]


def own_basis_loss(coefs: torch.Tensor, config, spend: float, token_group: int,
                   step: int = 8) -> tuple[float, float, int]:
    """(loss charged, loss free, rows) of coding coefs [C, D] on their own principal components."""
    count, width = coefs.shape
    total = float(coefs.square().sum())
    components = torch.linalg.svd(coefs, full_matrices=False)[2]  # [D, D], rows by decreasing variance
    free = preset_loss(coefs @ components.T, config, spend, token_group)
    best, rows = total, 0
    for r in range(step, width + 1, step):
        left = spend - r * width * BASIS_BYTES / count
        if left <= 0:
            break
        projected = coefs @ components[:r].T
        lost = preset_loss(projected, config, left, token_group) + total - float(projected.square().sum())
        if lost < best:
            best, rows = lost, r
    return best, free, rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budgets", default="0.1,0.2")
    parser.add_argument("--token-group", type=int, default=64, help="with coef_scales='component'")
    parser.add_argument("--layers", type=int, default=6, help="full-attention layers, evenly spread")
    args = parser.parse_args(argv)
    bases, captured, layers = held_out_capture(args.model, args.length, args.layers)
    print(f"# {args.model}, one held-out wiki context of {args.length} tokens: share of the coded residual's "
          f"energy lost, the shipped basis against the prompt's own (its rows paid from the budget)\n")
    print("| budget | layer | bytes / coded token | shipped | own basis, charged (rows) | own basis, free |")
    print("|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        config = bases.config("recommended", budget=budget, budget_dtype="float16")
        ratios = []
        for layer in layers:
            coefs = residual_coefficients(captured, layer, bases, config)
            total = float(coefs.square().sum())
            spend = bytes_per_token(config, budget, args.length, coefs.shape[1], coefs.shape[1])
            shipped = preset_loss(coefs, config, spend, args.token_group)
            charged, free, rows = own_basis_loss(coefs, config, spend, args.token_group)
            ratios.append(charged / shipped)
            print(f"| {budget} | {layer} | {spend:.1f} | {shipped / total:.3f} | {charged / total:.3f} ({rows}) | "
                  f"{free / total:.3f} |", flush=True)
        print(f"| {budget} | mean | | 1 | {sum(ratios) / len(ratios):.2f}x | |")


if __name__ == "__main__":
    main()
