"""Key/value balance (`VarRateConfig.balance="rms"`, `key_weight`): code z_t with chosen key and value energy.

In z_t = [k~_t ; v_t] the keys carry 1.3x to 30x the values' norm, so the nearest anchors and the
PCA basis follow the keys and the values come back with most of their error. Balancing scales the
value half by a per-layer factor a = sqrt(key residual energy / value residual energy), measured on
the calibration data, before anchor search and projection, and divides it out after decoding. The
basis for the scaled space is the top-R eigenbasis of A Sigma A, where Sigma = U^T diag(s^2) U is the
calibration second moment recovered from the shipped basis U [R, D] and its spectrum s [R] (exact
when R = D, as for every shipped artifact).

Shapes: basis [R, D] fp32, spectrum [R], scales [D] fp32 (1 on the key half, a on the value half).
`Bases.coding_basis` derives these once per layer and device and keeps them.
"""

from __future__ import annotations

import torch

from .pca import principal_components


def balanced_basis(basis: torch.Tensor, spectrum: torch.Tensor, balance: str = "rms", key_weight: float = 1.0,
                   key_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(basis of the scaled space [R, D] fp32, scales [D] fp32, its singular values [R]) for one layer.

    The value half is scaled by a (balance='rms'; 1 for 'none'), divided by `key_weight`: scaling the values
    down by w codes z = [w k ; v] up to one global factor, so a weight above 1 moves error, and with it
    bytes, from the keys to the values (anchors, basis and group-quantized codes all follow the scaling).
    `key_scales` [D / 2] (None: 1) scales the key half per dimension the same way (evaluation experiments: the
    decoder divides every scale out, but attention over the codes reads the key half unscaled)."""
    moment, scales = _scaled_moment(basis, spectrum, balance, key_weight, key_scales)
    balanced, singular = principal_components(moment, basis.shape[0])
    return balanced.to(basis.device), scales.float().to(basis.device), singular.float()


def balanced_spectrum(basis: torch.Tensor, spectrum: torch.Tensor, balance: str = "rms",
                      key_weight: float = 1.0) -> torch.Tensor:
    """The singular values [R] fp32 of `balanced_basis`'s scaled space alone (eigenvalues, no eigenvectors, on
    the CPU): what per-layer budgets need, without deriving or keeping a basis on any device."""
    moment, _ = _scaled_moment(basis, spectrum, balance, key_weight)
    eigenvalues = torch.linalg.eigvalsh((moment + moment.T) / 2)  # ascending
    return eigenvalues.flip(0)[:basis.shape[0]].clamp(min=0).sqrt().float()


def _scaled_moment(basis: torch.Tensor, spectrum: torch.Tensor, balance: str, key_weight: float,
                   key_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A Sigma A [D, D] fp64 on the CPU, the scales A [D] fp64) of one layer's scaled space."""
    width = basis.shape[1]
    half = width // 2
    u = basis.double().cpu()
    moment = u.T @ (spectrum.double().cpu().square()[:, None] * u)  # Sigma [D, D]
    diagonal = moment.diagonal()
    key_energy, value_energy = float(diagonal[:half].sum()), float(diagonal[half:].sum())
    if balance == "rms" and not (key_energy > 0 and value_energy > 0):
        raise ValueError(
            f"balance='rms' needs calibration energy in both halves, got keys {key_energy:.3g} and values "
            f"{value_energy:.3g}; use balance='none' with these bases"
        )
    scales = torch.ones(width, dtype=torch.float64)
    factor = (key_energy / value_energy) ** 0.5 if balance == "rms" else 1.0
    scales[half:] = factor / key_weight
    if key_scales is not None:
        scales[:half] = key_scales.double().cpu()
    return scales[:, None] * moment * scales[None, :], scales
