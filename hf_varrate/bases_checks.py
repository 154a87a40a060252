"""The bases artifact on disk: its file names, reading a folder, and checking the config.json fields and
every tensor.

Each failure is a `BasesError` that names the field or tensor, what was expected, what was found,
and the command that rebuilds the bases. The artifact's file names are defined here too, so that
`hf_varrate.hub` and `hf_varrate.card` need nothing from `hf_varrate.bases`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .architecture import ModelShape, describe
from .config import LOW_BUDGET, LOW_BUDGET_KEY, VarRateConfig
from .config_checks import PRESETS
from .errors import BasesError
from .rotary import RotaryFrequencies

WEIGHTS_NAME = "bases.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
ARTIFACT_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)
BUILD_HINT = "python -m hf_varrate.calibration --model <your model> --out <dir>"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB; anything larger is not ours
SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "width", "compressed_layers")
INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "width", "rank")
FORMAT_VERSION = 1  # spectrum.<i> is optional, so artifacts with and without it share version 1
# calibration settings a cache codes with by default (`Bases.config`): field -> largest sensible value
CALIBRATION_FIELDS = {"stride": 1 << 20, "window": 1 << 20, "n_anchors": 1024}


def build_hint(model_or_meta=None) -> str:
    """The command that builds bases, naming the model when it is known."""
    model = model_or_meta.get("model_id") if isinstance(model_or_meta, dict) else model_or_meta
    return BUILD_HINT.replace("<your model>", str(model)) if isinstance(model, str) and model else BUILD_HINT


def check_metadata(meta) -> dict:
    """Types and consistency of the shape fields of a config.json (already parsed)."""
    if not isinstance(meta, dict):
        raise BasesError(f"{CONFIG_NAME} must hold a JSON object, got {type(meta).__name__}; "
                         f"rebuild with: {BUILD_HINT}")
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
    check_layout(meta)
    check_calibration_fields(meta)
    check_tuned(meta)
    check_sensitivity(meta)
    return meta


def check_sensitivity(meta: dict) -> None:
    """The optional `layer_sensitivity` field (`hf_varrate.calibration.sensitivity`): sorted positive levels with 1
    among them, and per measured budget in (0, 1) a finite, non-negative KL per level for every compressed layer."""
    measured = meta.get("layer_sensitivity")
    if measured is None:
        return
    fix = "measure again with `hf-varrate measure-layers` or remove the field"
    levels = measured.get("levels") if isinstance(measured, dict) else None
    if (not isinstance(levels, list) or not levels or not all(_number(s) and s > 0 for s in levels)
            or levels != sorted(set(levels)) or 1.0 not in levels):
        raise BasesError(f"{CONFIG_NAME} field layer_sensitivity.levels must be sorted distinct positive numbers with "
                         f"1 among them, got {levels!r:.200}; {fix}")
    curves = measured.get("kl")
    layers = {str(i) for i in meta["compressed_layers"]}
    if not isinstance(curves, dict) or not curves:
        raise BasesError(f"{CONFIG_NAME} field layer_sensitivity.kl must map budgets to per-layer curves, got "
                         f"{curves!r:.200}; {fix}")
    for budget, rows in curves.items():
        try:
            valid = 0 < float(budget) < 1
        except ValueError:
            valid = False
        if not valid or not isinstance(rows, dict) or set(rows) != layers or not all(
                isinstance(row, list) and len(row) == len(levels) and all(_number(x) and 0 <= x < float("inf")
                                                                          for x in row) for row in rows.values()):
            raise BasesError(f"{CONFIG_NAME} field layer_sensitivity.kl[{budget!r}] must map every compressed layer "
                             f"{sorted(layers, key=int)} to {len(levels)} finite KLs >= 0 (one per level), and its "
                             f"budget must be in (0, 1); {fix}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_tuned(meta: dict) -> None:
    """The optional `presets` field: per preset name, settings that preset takes with these bases (chosen for the
    model), each a valid VarRateConfig field and value."""
    tuned = meta.get("presets", {})
    if not isinstance(tuned, dict) or not set(tuned) <= set(PRESETS) or not all(isinstance(v, dict) for v in
                                                                                  tuned.values()):
        raise BasesError(f"{CONFIG_NAME} field presets must map preset names ({list(PRESETS)}) to settings, got "
                         f"{tuned!r:.200}; fix or remove the field")
    for name, settings in tuned.items():
        low = settings.get(LOW_BUDGET_KEY, {})
        if not isinstance(low, dict):
            raise BasesError(f"{CONFIG_NAME} field presets.{name}.{LOW_BUDGET_KEY} must map settings to values, got "
                             f"{low!r:.200}; fix or remove the field")
        try:
            plain = {k: v for k, v in settings.items() if k != LOW_BUDGET_KEY}
            VarRateConfig.preset(name, **plain)
            VarRateConfig.preset(name, **{**plain, "budget": LOW_BUDGET, **low})
        except (TypeError, ValueError) as err:
            raise BasesError(f"{CONFIG_NAME} field presets.{name} is not a valid setting: {err}; fix or remove the "
                             f"field") from err


def check_calibration_fields(meta: dict) -> None:
    """`format_version` (if any) is one this version reads; the calibration settings a cache takes its
    defaults from (stride, window, n_anchors), where recorded, are integers in range."""
    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise BasesError(f"{CONFIG_NAME} field format_version is {version!r}, and this hf_varrate reads bases of "
                         f"format 1 to {FORMAT_VERSION}: upgrade it (pip install -U hf_varrate), or rebuild the "
                         f"bases with: {build_hint(meta)}")
    for name, largest in CALIBRATION_FIELDS.items():
        value = meta.get(name)
        if name in meta and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= largest):
            raise BasesError(f"{CONFIG_NAME} field {name} (a calibration setting that caches coding with these "
                             f"bases default to) must be an integer in [1, {largest}], got {value!r}; fix or "
                             f"remove the field, or rebuild the bases with: {build_hint(meta)}")


def check_layout(meta: dict) -> None:
    """The optional layout fields a cache built without the model reads: `sliding_window` (a positive
    integer or null) and `rope.full_attention` ({inv_freq: head_dim / 2 positive floats, attention_scaling})."""
    window = meta.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise BasesError(f"{CONFIG_NAME} field sliding_window must be a positive integer or null, got {window!r}; "
                         f"rebuild with: {build_hint(meta)}")
    rope = meta.get("rope")
    if rope is None:
        return
    full = rope.get("full_attention") if isinstance(rope, dict) else None
    freqs = full.get("inv_freq") if isinstance(full, dict) else None
    scaling = full.get("attention_scaling") if isinstance(full, dict) else None
    ok = isinstance(freqs, list) and len(freqs) == meta["head_dim"] // 2
    ok = ok and all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < float("inf") for f in freqs)
    ok = ok and isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and 0 < scaling < float("inf")
    if not ok:
        raise BasesError(f"{CONFIG_NAME} field rope must be {{'full_attention': {{'inv_freq': {meta['head_dim'] // 2} "
                         f"positive floats, 'attention_scaling': a positive float}}}}, got {rope!r:.200}; rebuild "
                         f"with: {build_hint(meta)}")


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
    """A float [rank, width] tensor, finite, with orthonormal rows (tolerance set by the values' precision:
    fp16 or bf16 values keep theirs when held in fp32, e.g. shipped fp16 bases re-saved as fp32)."""
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
    tolerance = 1e-2 if _half_precision(tensor) else 1e-4
    if gram_error > tolerance:
        raise BasesError(f"basis {name} does not have orthonormal rows: max |V V^T - I| is {gram_error:.3g}, "
                         f"above {tolerance:g} for {tensor.dtype}; rebuild it with: {BUILD_HINT}")


def _half_precision(tensor: torch.Tensor) -> bool:
    """Whether the values carry only fp16 or bf16 precision: stored in 2 bytes, or every value unchanged by a
    round trip through one of them."""
    if tensor.element_size() <= 2:
        return True
    return any(torch.equal(tensor.to(half).to(tensor.dtype), tensor) for half in (torch.float16, torch.bfloat16))


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


def read_files(folder: str | os.PathLike) -> tuple[dict, dict, dict]:
    """Read and verify a bases folder: JSON config, sha256 of the tensor file, then every tensor.
    Returns (tensors {layer: [R, D]}, metadata, spectra {layer: [R]}), as `Bases(...)` takes them."""
    from safetensors.torch import load

    folder = Path(folder)
    weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    for file in (weights, config):
        if not file.is_file():
            raise BasesError(f"{file} not found; build bases with: {BUILD_HINT}")
    metadata = check_metadata(_read_config(config))
    blob = weights.read_bytes()
    recorded = metadata.get("sha256", {}).get(WEIGHTS_NAME) if isinstance(metadata.get("sha256"), dict) else None
    if not isinstance(recorded, str):
        raise BasesError(f"{config} records no sha256 for {WEIGHTS_NAME} (field sha256.{WEIGHTS_NAME}); "
                         f"rebuild the bases with: {build_hint(metadata)}")
    actual = hashlib.sha256(blob).hexdigest()
    if actual != recorded.lower():
        raise BasesError(f"{weights} is corrupt or was changed: its sha256 is {actual} but {CONFIG_NAME} "
                         f"records {recorded} ({len(blob)} bytes read); download or rebuild it with: "
                         f"{build_hint(metadata)}")
    try:
        raw = load(blob)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # safetensors' Rust panics derive from BaseException
        raise BasesError(f"could not parse {weights}: {type(exc).__name__}: {exc}; rebuild it with: "
                         f"{build_hint(metadata)}") from exc
    check_tensors(raw, metadata)
    tensors, spectra = {}, {}
    for name, tensor in raw.items():
        kind, index = name.split(".")
        (tensors if kind == "layers" else spectra)[int(index)] = tensor
    return tensors, metadata, spectra


def looks_local(path: str) -> bool:
    """True for strings that can only be a filesystem path, never a Hub repo id ("name" or "org/name")."""
    return (path.startswith(("/", ".", "~")) or "\\" in path or path.count("/") > 1 or os.path.exists(path))


def _read_config(path: Path):
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise BasesError(f"{path} is {path.stat().st_size} bytes, more than a bases config can be "
                         f"({MAX_CONFIG_BYTES}); rebuild it with: {BUILD_HINT}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BasesError(f"{path} is not valid JSON ({type(exc).__name__}: {exc}); rebuild it with: "
                         f"{BUILD_HINT}") from exc


def shape_metadata(shape: ModelShape) -> dict:
    return {
        "model_id": shape.model_id,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "width": shape.width,
        "compressed_layers": list(shape.compressed_layers),
        "sliding_window": shape.sliding_window if len(shape.compressed_layers) < shape.num_layers else None,
    }


def check_fits_model(metadata: dict, tensors: dict, model_config) -> list[str]:
    """Raise `BasesError` if bases (their metadata and per-layer tensors) cannot serve `model_config`;
    return warnings (e.g. model id).

    Shapes must match exactly; a different model id with matching shapes is only a warning (a
    fine-tune of the calibrated model is a legitimate use). A model loaded from a local folder
    has no Hub id to compare, so it is not warned about.
    """
    shape = describe(model_config)
    expected = shape_metadata(shape)
    hint = build_hint(shape.model_id)
    for name in SHAPE_FIELDS:
        have, want = metadata.get(name), expected[name]
        if have is not None and list_or(have) != list_or(want):
            raise BasesError(f"bases do not fit this model: {name} is {have!r} in the bases but {want!r} in "
                             f"the model; build matching bases with: {hint}")
    for i in shape.compressed_layers:
        t = tensors.get(i)
        if t is None:
            raise BasesError(f"bases miss layer {i} (tensor layers.{i}); build complete bases with: {hint}")
        if t.ndim != 2 or t.shape[1] != shape.width or t.shape[0] > shape.width:
            raise BasesError(f"basis of layer {i} has shape {tuple(t.shape)}, expected [R <= {shape.width}, "
                             f"{shape.width}]; build matching bases with: {hint}")
    notes = []
    mine, theirs = metadata.get("model_id"), shape.model_id
    comparable = mine and theirs and not os.path.isdir(str(theirs))
    if comparable and mine != theirs and metadata.get("calibration") != "identity":
        notes.append(f"bases were calibrated on {mine!r} but the model is {theirs!r}; shapes match, so they "
                     f"will be used, but quality may differ")
    return notes


def list_or(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def layout_metadata(model) -> dict:
    """What a cache built without the model needs from it, to record in bases: the shape fields and the
    compressed layers' RoPE frequencies."""
    meta = shape_metadata(describe(model.config))
    rope = RotaryFrequencies.from_model(model)
    if rope is not None:
        meta["rope"] = {"full_attention": rope.to_metadata()}
    return meta
