"""Principal components of a second moment: the eigen-decomposition calibration and balance share.

Shapes: moment M [D, D] symmetric PSD (fp64), basis V [R, D] with rows ordered by decreasing eigenvalue.
"""

from __future__ import annotations

import torch


def principal_components(moment: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`rank` eigenvectors of a symmetric PSD [D, D] matrix, as rows ordered by decreasing
    eigenvalue, with a deterministic sign. Returns (V [R, D] fp32, singular values sqrt(lambda) [R])."""
    if not 1 <= rank <= moment.shape[0]:
        raise ValueError(f"rank must be in [1, {moment.shape[0]}], got {rank}")
    m = moment.double().cpu()
    eigenvalues, eigenvectors = torch.linalg.eigh((m + m.T) / 2)  # ascending
    order = torch.argsort(eigenvalues, descending=True, stable=True)[:rank]
    basis = orient(eigenvectors[:, order].T.contiguous())  # [R, D]
    return basis.float(), eigenvalues[order].clamp(min=0).sqrt()


def orient(basis: torch.Tensor) -> torch.Tensor:
    """Flip each row so its largest-magnitude entry (the first, on ties) is positive."""
    pivot = basis.abs().argmax(dim=1, keepdim=True)  # [R, 1]
    signs = torch.sign(basis.gather(1, pivot))
    return basis * torch.where(signs == 0, torch.ones_like(signs), signs)
