"""Per-layer budgets from the calibration spectra (`VarRateConfig.layer_budgets="spectrum"`).

Under Eq. 3 every layer gets the same coefficient budget. With flat ranks rho_l, layer l loses the
share sum_{j >= rho_l} e_lj of its calibration residual energy (e_lj = s_lj^2 / sum_j s_lj^2,
descending in j). For a fixed total sum_l rho_l the summed loss is smallest when every layer keeps
the directions above one common threshold of e (each loss is convex in rho_l since the shares
descend): a water-filling across layers, in which rank goes where it removes the most relative
error. A layer whose energy sits in a few directions it already keeps gives rank to layers whose
energy is spread past the flat rank. Every layer keeps at least half the flat rank, so that no
layer's codes starve when the spectra are far apart. Training-free: the spectra ship with the bases
(`spectrum.<i>`), and the balanced space's come from the same moment.

Shapes: energies [L, R] fp64 (rows descending, each summing to 1), ranks [L].
"""

from __future__ import annotations

import math

import torch


def energy_shares(spectra: list[torch.Tensor]) -> torch.Tensor:
    """[L, R] each layer's singular values squared, as shares of the layer's total."""
    energy = torch.stack([s.double().cpu().square() for s in spectra])
    return energy / energy.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)


def layer_ranks(energies: torch.Tensor, flat: float, floor: int) -> torch.Tensor:
    """[L] flat ranks that share floor(L * flat) ranks: `floor` each, the rest to the largest shares."""
    layers, rank = energies.shape
    floor = min(max(floor, 0), rank)
    ranks = torch.full((layers,), floor, dtype=torch.long)
    spare = math.floor(layers * min(flat, rank)) - layers * floor
    if spare > 0 and floor < rank:
        pool = energies[:, floor:].T.reshape(-1)  # direction-major: ties go to the layers in turn
        top = torch.argsort(pool, descending=True, stable=True)[:spare]
        ranks += torch.bincount(top % layers, minlength=layers)
    return ranks


def budget_scale(energies: torch.Tensor, row: int, flat: float, floor: int) -> float:
    """Layer `row`'s coefficient budget over the uniform one (the scales of all layers average to 1)."""
    ranks = layer_ranks(energies, flat, floor).double()
    total = float(ranks.sum())
    return float(ranks[row]) * ranks.numel() / total if total > 0 else 1.0
