"""Energy ranks read on the keys (`eval_energy_value_weight: w`, evaluation only, a hypothesis).

`allocation="distortion"` gives each coded token the ranks that keep the most of its coefficient energy in the
joint coding space, where a component's energy is its key part's plus its value part's. On Gemma-3 those ranks
moved rank into the values, which that model's answers do not need (docs/accuracy_dev.md, round 26), and lost
answers there. Here component j of token t counts c_tj^2 * (||b_j^K||^2 + w ||b_j^V||^2) instead of c_tj^2, with
b_j the basis row (unit norm, in the coding space, so the key weight is in it) and K / V its key and value
halves: w = 0 ranks by the energy the truncation takes from the keys alone (the diagonal of that error: the
components are uncorrelated on calibration text), w = 1 is the library. Only the ranks change; the
coefficients stored, their bytes and the decoder are the library's.

It wraps the codec's projection and allocation (`hf_varrate.codec.pipeline.encode` and `.distortion_ranks`)
around one prompt's coding and restores them afterwards: the allocation's energy comes from the projection
onto `basis[:rank]` just before it, whose rows give the shares.
"""

from __future__ import annotations

import contextlib

import torch

from hf_varrate.codec import pipeline


def component_weights(basis: torch.Tensor, value_weight: float) -> torch.Tensor:
    """[R] fp32: ||b_j^K||^2 + value_weight * ||b_j^V||^2 for the rows b_j of `basis` [R, D] (keys: the first D / 2
    columns, as `joint_rows` lays z out)."""
    rows = basis.float().square()
    half = rows.shape[1] // 2
    return rows[:, :half].sum(1) + value_weight * rows[:, half:].sum(1)


@contextlib.contextmanager
def key_energy(value_weight: float):
    """Within the block, `allocation="distortion"` ranks by energy with the value half weighted by `value_weight`."""
    if not 0.0 <= value_weight <= 1.0:
        raise ValueError(f"eval_energy_value_weight={value_weight!r}: must be in [0, 1] (0: the keys' energy "
                         f"alone, 1: the library's joint energy)")
    encode, distortion_ranks = pipeline.encode, pipeline.distortion_ranks
    last: dict = {}

    def weighed_encode(residuals, basis, dtype=torch.float32):
        last["weights"] = component_weights(basis, value_weight)
        return encode(residuals, basis, dtype)

    def weighed_ranks(energy, total, r_min, r_max, **kwargs):
        weights = last.pop("weights")  # from the projection this energy is the square of
        return distortion_ranks(energy * weights[: energy.shape[1]].to(energy.device), total, r_min, r_max, **kwargs)

    pipeline.encode, pipeline.distortion_ranks = weighed_encode, weighed_ranks
    try:
        yield
    finally:
        pipeline.encode, pipeline.distortion_ranks = encode, distortion_ranks
