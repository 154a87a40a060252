"""Validation of a bases artifact's parsed contents: the config.json fields and every tensor.

Each failure is a `BasesError` that names the field or tensor, what was expected, what was found,
and the command that rebuilds the bases. `hf_varrate.bases` re-exports everything here.
"""

from __future__ import annotations

import torch

WEIGHTS_NAME = "bases.safetensors"
CONFIG_NAME = "config.json"
BUILD_HINT = "python -m hf_varrate.calibration --model <your model> --out <dir>"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "width", "rank")


class BasesError(ValueError):
    """A bases artifact is missing, corrupt, or does not fit the model it meets."""


def build_hint(model_or_meta=None) -> str:
    """The command that builds bases, naming the model when it is known."""
    model = model_or_meta.get("model_id") if isinstance(model_or_meta, dict) else model_or_meta
    return BUILD_HINT.replace("<your model>", str(model)) if isinstance(model, str) and model else BUILD_HINT


def check_metadata(meta) -> dict:
    """Types and consistency of the shape fields of a config.json (already parsed)."""
    if not isinstance(meta, dict):
        raise BasesError(f"{CONFIG_NAME} must hold a JSON object, got {type(meta).__name__}; rebuild with: {BUILD_HINT}")
    for name in INT_FIELDS:
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BasesError(f"{CONFIG_NAME} field {name} must be a positive integer, got {value!r}; "
                             f"rebuild with: {build_hint(meta)}")
    layers = meta.get("compressed_layers")
    if (not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            or layers != sorted(set(layers)) or not all(0 <= i < meta["num_layers"] for i in layers)):
        raise BasesError(f"{CONFIG_NAME} field compressed_layers must be sorted distinct layer indices in "
                         f"[0, {meta['num_layers']}), got {layers!r}; rebuild with: {build_hint(meta)}")
    if meta["width"] != 2 * meta["num_kv_heads"] * meta["head_dim"]:
        raise BasesError(f"{CONFIG_NAME} field width is {meta['width']} but 2 * num_kv_heads * head_dim is "
                         f"{2 * meta['num_kv_heads'] * meta['head_dim']}; rebuild with: {build_hint(meta)}")
    if meta["rank"] > meta["width"]:
        raise BasesError(f"{CONFIG_NAME} field rank is {meta['rank']}, above width {meta['width']}; "
                         f"rebuild with: {build_hint(meta)}")
    return meta


def check_tensors(raw: dict[str, torch.Tensor], meta: dict) -> None:
    """The tensor file holds exactly `layers.<i>` for each compressed layer, each a valid basis, and
    optionally `spectrum.<i>` for every one of those layers (all or none), each a valid spectrum."""
    layers = [f"layers.{i}" for i in meta["compressed_layers"]]
    spectra = [f"spectrum.{i}" for i in meta["compressed_layers"]]
    present = [name for name in spectra if name in raw]
    expected = set(layers) | (set(spectra) if present else set())
    missing, extra = sorted(expected - set(raw)), sorted(set(raw) - expected)
    if missing or extra:
        what = "one basis per compressed layer, and a spectrum for all of them or none"
        raise BasesError(f"{WEIGHTS_NAME} must hold {what}: missing {missing}, unexpected {extra}; "
                         f"rebuild it with: {build_hint(meta)}")
    for name in layers:
        check_basis(name, raw[name], meta["rank"], meta["width"])
    for name in present:
        check_spectrum(name, raw[name], meta["rank"])


def check_basis(name: str, tensor: torch.Tensor, rank: int, width: int) -> None:
    """A float [rank, width] tensor, finite, with orthonormal rows (tolerance set by its dtype)."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise BasesError(f"basis {name} has dtype {tensor.dtype}, expected one of "
                         f"{[str(d) for d in FLOAT_DTYPES]}; rebuild it with: {BUILD_HINT}")
    if tuple(tensor.shape) != (rank, width):
        raise BasesError(f"basis {name} has shape {tuple(tensor.shape)}, expected [rank, width] = "
                         f"[{rank}, {width}]; rebuild it with: {BUILD_HINT}")
    if not bool(torch.isfinite(tensor).all()):
        raise BasesError(f"basis {name} contains NaN or inf; rebuild it with: {BUILD_HINT}")
    v = tensor.float()  # fp32 Gram: its own rounding (~1e-6 at D = 4096) is far below either tolerance
    gram_error = float((v @ v.T - torch.eye(rank)).abs().max())
    tolerance = 1e-2 if tensor.element_size() <= 2 else 1e-4
    if gram_error > tolerance:
        raise BasesError(f"basis {name} does not have orthonormal rows: max |V V^T - I| is {gram_error:.3g}, "
                         f"above {tolerance:g} for {tensor.dtype}; rebuild it with: {BUILD_HINT}")


def check_spectrum(name: str, tensor: torch.Tensor, rank: int) -> None:
    """A float [rank] tensor of singular values: finite, >= 0, non-increasing (one per basis row)."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise BasesError(f"spectrum {name} has dtype {tensor.dtype}, expected one of "
                         f"{[str(d) for d in FLOAT_DTYPES]}; rebuild it with: {BUILD_HINT}")
    if tuple(tensor.shape) != (rank,):
        raise BasesError(f"spectrum {name} has shape {tuple(tensor.shape)}, expected [rank] = [{rank}]; "
                         f"rebuild it with: {BUILD_HINT}")
    if not bool(torch.isfinite(tensor).all()):
        raise BasesError(f"spectrum {name} contains NaN or inf; rebuild it with: {BUILD_HINT}")
    if bool((tensor < 0).any()):
        raise BasesError(f"spectrum {name} has a negative singular value ({float(tensor.min()):.6g}); "
                         f"rebuild it with: {BUILD_HINT}")
    rises = torch.nonzero(tensor[1:] > tensor[:-1])
    if rises.numel():
        j = int(rises[0])
        raise BasesError(f"spectrum {name} is not non-increasing: entry {j + 1} ({float(tensor[j + 1]):.6g}) "
                         f"exceeds entry {j} ({float(tensor[j]):.6g}); rebuild it with: {BUILD_HINT}")
