"""Paired statistics, as in the paper (Section 4.1, Appendix A.13).

Every comparison is paired over examples: d_i = score_a[i] - score_b[i]. We report the mean
difference, a 20,000-sample paired bootstrap 95% CI of it (`scipy.stats.bootstrap` on the d_i), and
an exact two-sided sign test (the binomial test at p = 1/2, ties dropped). A comparison counts only when
the CI excludes zero.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

BOOTSTRAP_SAMPLES = 20_000


@dataclass
class PairedComparison:
    n: int
    mean_diff: float
    ci_low: float
    ci_high: float
    wins: int  # d > 0
    losses: int  # d < 0
    ties: int
    sign_p: float

    @property
    def significant(self) -> bool:
        """The paper's rule: the bootstrap CI excludes zero."""
        return self.ci_low > 0 or self.ci_high < 0

    @property
    def verdict(self) -> str:
        if not self.significant:
            return "tie"
        return "better" if self.mean_diff > 0 else "worse"

    def to_dict(self) -> dict:
        return {**asdict(self), "significant": self.significant, "verdict": self.verdict}


def bootstrap_mean_ci(values, *, samples: int = BOOTSTRAP_SAMPLES, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values` (resampled with replacement).

    `scipy.stats.bootstrap` draws the resamples and their means (in batches of 2,000: memory stays at
    2,000 x n); the interval is read from that distribution at the (1 - level) / 2 * 100 percentiles,
    as the committed tables were (scipy's own `confidence_interval` places them at alpha * 100, which
    moves some CIs in their last bits)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:  # scipy needs two observations; one value is its own interval
        return (float(x[0]), float(x[0])) if x.size else (math.nan, math.nan)
    result = stats.bootstrap((x,), np.mean, n_resamples=samples, batch=2_000, confidence_level=level,
                             method="percentile", rng=np.random.default_rng(seed))
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(result.bootstrap_distribution, [tail, 100 - tail])
    return float(low), float(high)


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test p-value for `wins` positive and `losses` negative differences.

    Summed in integers, so exact to the last bit: `scipy.stats.binomtest(wins, n).pvalue` is the same test
    (tests/test_evaluation.py checks it) but sums floats, and differs in the last bits for n near 100,
    which would rewrite committed tables."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(a, b, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> PairedComparison:
    """Compare paired scores a[i] vs b[i] (same examples, same order)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired scores must have the same shape, got {a.shape} and {b.shape}")
    d = a - b
    low, high = bootstrap_mean_ci(d, samples=samples, seed=seed)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    return PairedComparison(int(d.size), float(d.mean()) if d.size else math.nan, low, high, wins, losses,
                            int(d.size) - wins - losses, sign_test(wins, losses))
