"""Streaming PCA of the residuals: an fp64 second moment per layer, then its top-R eigenvectors.

Shapes: residuals e [C, D]; moment M = sum e^T e [D, D]; basis V [R, D]. The eigenvectors of M are
the right singular vectors of the stacked residuals and its eigenvalues their squared singular
values, so memory is D x D per layer however many contexts and tokens go in.
"""

from __future__ import annotations

import torch

from ..codec.pca import orient, principal_components  # noqa: F401 (re-exported)


class SecondMoments:
    """Per-layer running sums M_l = sum_t e_t e_t^T (fp64) and residual counts."""

    def __init__(self, width: int, layers, device=None):
        self.width = width
        self.moments = {i: torch.zeros(width, width, dtype=torch.float64, device=device) for i in layers}
        self.counts = {i: 0 for i in layers}

    def add(self, layer_idx: int, residuals: torch.Tensor) -> None:
        """Accumulate residuals [C, D] of one context of layer `layer_idx`."""
        e = residuals.to(self.moments[layer_idx].device, torch.float64)
        self.moments[layer_idx].addmm_(e.T, e)  # [D, D]
        self.counts[layer_idx] += e.shape[0]

    def components(self, rank: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Per layer: (V [R, D] fp32, singular values [R] fp64), see `principal_components`."""
        bases, singular = {}, {}
        for i, moment in self.moments.items():
            bases[i], singular[i] = principal_components(moment, rank)
        return bases, singular
