"""Rank allocation: water-filling (Eq. 5, Algorithm 1 lines 6-11), the binary top-K ablation, and beyond the
paper the ranks that leave the least coefficient energy untransmitted (`distortion_ranks`).

Shapes: salience s-hat [C] in [0, 1]; energy [C, K] (squared coefficients); ranks [C] long. Water-filling is
solved in closed form on the sorted salience (one sort, one cumulative sum), not by the reference's iterative
loop of tiny kernels.
"""

from __future__ import annotations

import math

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


def distortion_ranks(energy: torch.Tensor, total: int, r_min: int, r_max: int, steps: int = 40,
                     slack: float = 1 / 32, sample: int = 256) -> torch.Tensor:
    """Integer ranks in [r_min, r_max] summing to `total` that keep the most of each token's coefficient energy.

    energy [C, K >= r_max]: token t's squared coefficients in basis order, so truncating it at rank r loses
    sum(energy[t, r:]). Minimizing the summed loss at a fixed total rank is the rate-distortion allocation of
    transform coding: each token takes the rank maximizing kept energy - theta * rank (the concave hull of its
    cumulative energy), one price theta for all. The price is first bisected (geometrically) on about `sample`
    evenly spaced tokens, then bracketed and refined on all of them by regula falsi (Illinois) on log(theta),
    at most 2 * `steps` rounds, until the ranks fall short of `total` by at most `slack` ranks per token; those
    last ranks go one by one to the tokens whose next coefficient holds the most energy. Equal tokens get equal
    ranks; a token whose tail is large (what the basis does not predict) gets more.
    """
    count = energy.shape[0]
    _check_total(total, count, r_min, r_max)
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=energy.device)
    e = torch.nan_to_num(energy[:, :r_max].float(), nan=0.0, posinf=0.0).clamp(min=0.0)
    kept = e.cumsum(1)[:, r_min - 1 :] if r_min > 0 else torch.cat([e.new_zeros(count, 1), e.cumsum(1)], 1)
    kept -= kept[:, :1].clone()  # [C, r_max - r_min + 1]: energy kept above the floor at each rank
    spare = total - count * r_min
    above = _ranks_at_price(kept, 0.0)  # every token keeps all it has
    if int(above.sum()) > spare:  # else the fill below spends the rest
        part = kept[:: max(1, count // sample)]
        theta = _price_for(part, spare * part.shape[0] / count, float(e.max()) + 1.0)
        above = _refine_price(kept, spare, theta, steps, slack * count)
    ranks = above + r_min
    missing = total - int(ranks.sum())
    while missing > 0:  # by the next coefficient's energy; at most r_max rounds
        open_ = ranks < r_max
        gain = torch.where(open_, e.gather(1, ranks.clamp(max=r_max - 1)[:, None])[:, 0], e.new_full((), -1.0))
        take = min(missing, int(open_.sum()))
        ranks[torch.topk(gain, take).indices] += 1
        missing -= take
    return ranks


def _ranks_at_price(kept: torch.Tensor, theta: float) -> torch.Tensor:
    """Each row's rank above the floor maximizing kept energy - theta * rank (the smallest of tied ranks)."""
    steps_up = torch.arange(kept.shape[1], device=kept.device, dtype=kept.dtype)
    return _first_argmax(torch.sub(kept, steps_up, alpha=theta))


def _first_argmax(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(1), the first of tied maxima; on the CPU through NumPy, whose row argmax is vectorized
    (about 10x torch's on a [2000, 384] fp32 matrix, the same indices)."""
    if values.device.type != "cpu":
        return values.argmax(1)
    return torch.from_numpy(values.detach().numpy().argmax(1))


def _price_for(kept: torch.Tensor, spare: float, high: float) -> float:
    """A price at which the rows' ranks sum to about `spare`: bisected geometrically from (high * 2^-60, high],
    where every row stays at the floor, to a ratio of 1.002."""
    low = high * 2.0**-60
    while high > low * 1.002:
        middle = math.sqrt(low * high)
        if int(_ranks_at_price(kept, middle).sum()) > spare:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def _refine_price(kept: torch.Tensor, spare: int, theta: float, steps: int, slack: float) -> torch.Tensor:
    """The ranks at the lowest price found whose total is at most `spare` and within `slack` of it. One bracket
    [low, high] on the price (the ranks exceed `spare` at low and fit at high): while a side is unknown the
    estimate `theta` is moved out by factors of 1.01, 1.02, 1.04, ... on that side; once both are known, Illinois
    steps (regula falsi on log(price), the ranks' total as the function, halving the weight of the side that
    stays). At most `2 * steps` evaluations."""
    start, factor = theta, 1.01
    low = high = None  # the bracket's prices
    low_weight = high_weight = high_excess = 0  # the Illinois weights (the sides' excesses, halved), high's excess
    best, side = None, 0  # the ranks at high; which side moved last (-1 low, 1 high)
    for _ in range(2 * steps):
        ranks = _ranks_at_price(kept, theta)
        excess = int(ranks.sum()) - spare
        if excess > 0:  # the price is too low
            low, low_weight = theta, excess
            high_weight, side = (high_weight / 2 if side == -1 else high_weight), -1
        else:
            high, high_excess, high_weight, best = theta, excess, excess, ranks
            low_weight, side = (low_weight / 2 if side == 1 else low_weight), 1
        if high is not None and (-high_excess <= slack or low is not None and high <= low * (1 + 1e-12)):
            break
        if low is None or high is None:
            theta, factor = (start * factor if high is None else start / factor), factor * factor
            continue
        x_low, x_high = math.log(low), math.log(high)
        theta = math.exp(x_low + (x_high - x_low) * low_weight / (low_weight - high_weight))
        if not low < theta < high:
            theta = math.sqrt(low * high)
    return best if best is not None else torch.zeros_like(ranks)  # no price found that low: every row at the floor


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
