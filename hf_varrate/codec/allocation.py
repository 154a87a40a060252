"""Rank allocation: water-filling (Eq. 5, Algorithm 1 lines 6-11) and the binary top-K ablation.

Shapes: salience s-hat [C] in [0, 1]; ranks [C] long. Solved in closed form on the sorted
salience (one sort, one cumulative sum), not by the reference's iterative loop of tiny kernels.
"""

from __future__ import annotations

import torch


def waterfill_ranks(salience: torch.Tensor, total: int, r_min: int, r_max: int) -> torch.Tensor:
    """Integer ranks r_t = clip(r_min + lambda * s_t, r_min, r_max) with sum r_t == total.

    `total` must lie in [C * r_min, C * r_max]. lambda is found exactly: with the k most salient
    tokens at the cap, lambda_k = (total - k*r_max - (C-k)*r_min) / sum(s of the rest), and the
    right k is the first for which the (k+1)-th token stays under the cap. Rounding by largest
    remainder keeps the integer total equal to `total` (never above the budget).
    """
    count = salience.numel()
    _check_total(total, count, r_min, r_max)
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=salience.device)
    s = torch.nan_to_num(salience.double(), nan=0.0).clamp(min=0.0)
    order = torch.argsort(s, descending=True, stable=True)
    s_sorted = s[order]
    k = torch.arange(count, device=s.device, dtype=torch.float64)  # tokens capped before position k
    rest = torch.flip(torch.cumsum(torch.flip(s_sorted, [0]), 0), [0])  # sum of s_sorted[k:]
    spare = total - k * r_max - (count - k) * r_min
    lam = spare / rest.clamp(min=1e-300)
    fits = (r_min + lam * s_sorted <= r_max) | (rest <= 0)
    first = int(torch.nonzero(fits)[0]) if bool(fits.any()) else count
    real = torch.full((count,), float(r_min), dtype=torch.float64, device=s.device)
    real[:first] = r_max
    if first < count:
        if float(rest[first]) > 0:
            real[first:] = r_min + lam[first] * s_sorted[first:]
        else:  # every uncapped token has zero salience: spread what is left evenly
            real[first:] = r_min + float(spare[first]) / (count - first)
    ranks = torch.empty(count, dtype=torch.long, device=s.device)
    ranks[order] = _round_to_total(real.clamp(r_min, r_max), total, r_max)
    return ranks


def topk_ranks(salience: torch.Tensor, total: int, r_min: int, r_max: int) -> torch.Tensor:
    """The binary split of Table 4: the most salient tokens at r_max, the rest at r_min, sum == total."""
    count = salience.numel()
    _check_total(total, count, r_min, r_max)
    ranks = torch.full((count,), r_min, dtype=torch.long, device=salience.device)
    if count == 0 or r_max == r_min:
        return ranks
    spare = total - count * r_min
    winners, leftover = divmod(spare, r_max - r_min)
    order = torch.argsort(torch.nan_to_num(salience.float(), nan=0.0), descending=True, stable=True)
    ranks[order[:winners]] = r_max
    if leftover and winners < count:
        ranks[order[winners]] += leftover
    return ranks


def _round_to_total(real: torch.Tensor, total: int, r_max: int) -> torch.Tensor:
    """Largest-remainder rounding of real ranks (already sorted by salience) to integers summing to total."""
    ranks = real.floor().long()
    missing = total - int(ranks.sum())
    if missing > 0:
        frac = (real - ranks).masked_fill(ranks >= r_max, -1.0)
        ranks[torch.argsort(frac, descending=True, stable=True)[:missing]] += 1
    return ranks


def _check_total(total: int, count: int, r_min: int, r_max: int) -> None:
    if r_min > r_max:
        raise ValueError(
            f"r_min must be <= the rank cap R, got r_min={r_min} and R={r_max} (R is the smallest of "
            f"VarRateConfig.rank, the basis rank and D = 2*H*d); lower r_min to at most {r_max} or use a basis of "
            f"higher rank"
        )
    if not count * r_min <= total <= count * r_max:
        raise ValueError(
            f"total rank must be in [{count * r_min}, {count * r_max}] for {count} tokens with ranks in "
            f"[{r_min}, {r_max}], got {total}; clip it to that range (the caller decides what an infeasible "
            f"budget means: VarRateCache stores such a prompt exactly)"
        )
