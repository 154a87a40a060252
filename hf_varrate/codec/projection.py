"""Encode once at full rank, truncate per token, decode (Section 3.3, Eq. 6).

Shapes: residuals e [C, D] fp32, basis V [R, D] fp32 with orthonormal rows, coefficients [C, R],
ranks [C], packed coefficients [sum(ranks)] (row-major: token 0's leading r_0, then token 1's...).
"""

from __future__ import annotations

import torch


def encode(residuals: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """c_t = V e_t for every coded token, at the full rank R: [C, D] -> [C, R]."""
    return residuals.float() @ basis.float().T


def rank_mask(ranks: torch.Tensor, rank: int) -> torch.Tensor:
    """[C, R] bool: the nested mask m_{t,j} = 1[j < r_t]."""
    return torch.arange(rank, device=ranks.device)[None, :] < ranks[:, None].long()


def pack(coefs: torch.Tensor, ranks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keep each token's leading r_t coefficients: [C, R] -> [sum(ranks)] in `dtype`."""
    return coefs[rank_mask(ranks, coefs.shape[1])].to(dtype)


def unpack(packed: torch.Tensor, ranks: torch.Tensor, rank: int) -> torch.Tensor:
    """Inverse of `pack`: [sum(ranks)] -> [C, R] fp32 with zeros past each token's rank."""
    coefs = torch.zeros(ranks.numel(), rank, dtype=torch.float32, device=packed.device)
    coefs[rank_mask(ranks, rank)] = packed.float()
    return coefs


def decode(means: torch.Tensor, coefs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Eq. 6: z-hat_t = z-bar_t + V^T (m_t * c_t). coefs [C, R] already masked -> [C, D] fp32."""
    return means.float() + coefs @ basis[: coefs.shape[1]].float()
