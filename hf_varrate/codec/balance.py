"""Key/value balance (issue #8, `VarRateConfig.balance="rms"`): code z_t with equal key and value energy.

In z_t = [k~_t ; v_t] the keys carry 1.3x to 30x the values' norm, so the nearest anchors and the
PCA basis follow the keys and the values come back with most of their error. Balancing scales the
value half by a per-layer factor a = sqrt(key residual energy / value residual energy), measured on
the calibration data, before anchor search and projection, and divides it out after decoding. The
basis for the scaled space is the top-R eigenbasis of A Sigma A, where Sigma = U^T diag(s^2) U is the
calibration second moment recovered from the shipped basis U [R, D] and its spectrum s [R] (exact
when R = D, as for every shipped artifact).

Shapes: basis [R, D] fp32, spectrum [R], scales [D] fp32 (1 on the key half, a on the value half).
"""

from __future__ import annotations

import torch

from .layer_budget import energy_shares


def balanced_basis(basis: torch.Tensor, spectrum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(basis of the balanced space [R, D] fp32, scales [D] fp32, its singular values [R]) for one layer."""
    from ..calibration.pca import principal_components  # calibration imports codec: import late

    rank, width = basis.shape
    half = width // 2
    u = basis.double().cpu()
    moment = u.T @ (spectrum.double().cpu().square()[:, None] * u)  # Sigma [D, D]
    diagonal = moment.diagonal()
    key_energy, value_energy = float(diagonal[:half].sum()), float(diagonal[half:].sum())
    if not (key_energy > 0 and value_energy > 0):
        raise ValueError(
            f"balance='rms' needs calibration energy in both halves, got keys {key_energy:.3g} and values "
            f"{value_energy:.3g}; use balance='none' with these bases"
        )
    scales = torch.ones(width, dtype=torch.float64)
    scales[half:] = (key_energy / value_energy) ** 0.5
    balanced, singular = principal_components(scales[:, None] * moment * scales[None, :], rank)
    return balanced.to(basis.device), scales.float().to(basis.device), singular.float()


def coding_basis(bases, layer_idx: int, balance: str, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The basis a layer codes with and its half scales (None: unbalanced, the paper's z_t)."""
    basis = bases.for_layer(layer_idx, device)
    if balance == "none":
        return basis, None
    cache = bases.__dict__.setdefault("_balanced", {})
    key = (layer_idx, str(basis.device))
    if key not in cache:
        spectrum = bases.spectrum(layer_idx) if hasattr(bases, "spectrum") else None
        if spectrum is None:
            raise ValueError(
                f"balance={balance!r} needs bases that carry their calibration spectrum (tensors spectrum.<i>), "
                f"and these have none for layer {layer_idx}; recalibrate them with this version of hf_varrate "
                f"(hf-varrate calibrate ...) or use balance='none'"
            )
        balanced, scales, singular = balanced_basis(basis, spectrum)
        cache[key] = balanced, scales
        bases.__dict__.setdefault("_balanced_spectra", {})[layer_idx] = singular
    return cache[key]


def coding_energies(bases, balance: str) -> tuple[torch.Tensor, dict[int, int]]:
    """(energies [L, R] of every compressed layer's coding space, {layer index: row}) for per-layer
    budgets (`layer_budget`): the shipped spectra, or the balanced space's for balance='rms'."""
    cache = bases.__dict__.setdefault("_energies", {})
    if balance not in cache:
        layers = sorted(bases.tensors)
        missing = [i for i in layers if bases.spectrum(i) is None]
        if missing:
            raise ValueError(
                f"layer_budgets='spectrum' needs bases that carry their calibration spectrum (tensors spectrum.<i>), "
                f"and these have none for layers {missing[:5]}; recalibrate them with this version of hf_varrate "
                f"(hf-varrate calibrate ...) or use layer_budgets='uniform'"
            )
        if balance == "none":
            spectra = [bases.spectrum(i) for i in layers]
        else:
            for i in layers:
                coding_basis(bases, i, balance)
            spectra = [bases.__dict__["_balanced_spectra"][i] for i in layers]
        cache[balance] = energy_shares(spectra), {i: row for row, i in enumerate(layers)}
    return cache[balance]


def layer_share(bases, layer_idx: int, config) -> tuple[torch.Tensor, int] | None:
    """What `compress_prompt(layer_share=...)` takes for layer `layer_idx` under `config.layer_budgets`
    ('spectrum': the coding spaces' energies and this layer's row; 'uniform': None)."""
    if config.layer_budgets == "uniform":
        return None
    energies, rows = coding_energies(bases, config.balance)
    return energies, rows[layer_idx]
