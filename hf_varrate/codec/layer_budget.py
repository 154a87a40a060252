"""Per-layer budgets: from the calibration spectra (`VarRateConfig.layer_budgets="spectrum"`), or from each
layer's measured sensitivity (`"measured"`, `measured_scales`).

Under Eq. 3 every layer gets the same coefficient budget. With flat ranks rho_l, layer l loses the
share sum_{j >= rho_l} e_lj of its calibration residual energy (e_lj = s_lj^2 / sum_j s_lj^2,
descending in j). For a fixed total sum_l rho_l the summed loss is smallest when every layer keeps
the directions above one common threshold of e (each loss is convex in rho_l since the shares
descend): a water-filling across layers, in which rank goes where it removes the most relative
error. A layer whose energy sits in a few directions it already keeps gives rank to layers whose
energy is spread past the flat rank. Every layer keeps at least half the flat rank, so that no
layer's codes starve when the spectra are far apart. Training-free: the spectra ship with the bases
(`spectrum.<i>`), and the balanced space's come from the same moment.

Measured: the bases carry, per budget, each layer's next-token KL against the full cache with that layer alone
coded at a few multiples ("levels") of the uniform budget (`hf_varrate.calibration.sensitivity`). A
multiple-choice knapsack then picks one level per layer, least summed KL, with the levels averaging exactly 1:
the same bytes as uniform budgets, moved to the layers whose error moves the model most.

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


def measured_scales(kl: dict[int, list[float]], levels: list[float]) -> dict[int, float]:
    """{layer: level} averaging exactly 1 with the least summed KL (`kl[layer][j]`: KL at `levels[j]`; the levels
    sorted, 1 among them, on a grid of their smallest gap). A dynamic program over the bytes used, in grid units."""
    unit = min(b - a for a, b in zip(levels, levels[1:])) if len(levels) > 1 else 1.0
    steps = [round(level / unit) for level in levels]
    target = round(len(kl) / unit)
    best: dict[int, tuple[float, list[float]]] = {0: (0.0, [])}
    for layer in sorted(kl):
        reached: dict[int, tuple[float, list[float]]] = {}
        for used, (cost, picks) in best.items():
            for level, step, loss in zip(levels, steps, kl[layer]):
                total = used + step
                if total <= target and (total not in reached or cost + loss < reached[total][0]):
                    reached[total] = (cost + loss, picks + [level])
        best = reached
    return dict(zip(sorted(kl), best[target][1]))


def recorded_scales(measured: dict) -> dict[str, dict[int, float]]:
    """{budget: {layer: scale}} of a bases' `layer_sensitivity` field: `measured_scales` at each budget it records."""
    return {budget: measured_scales({int(i): row for i, row in curves.items()}, measured["levels"])
            for budget, curves in measured["kl"].items()}
