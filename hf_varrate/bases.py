"""`Bases`: the per-layer PCA bases V [R, D] of one model, and their on-disk artifact.

Artifact (a local directory or a Hub repo): `bases.safetensors` (tensor `layers.<i>` per compressed
layer, fp16 or fp32), `config.json` (sorted keys, see `Bases.metadata`) and a `README.md` card.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .architecture import ModelShape, describe

WEIGHTS_NAME = "bases.safetensors"
CONFIG_NAME = "config.json"
BUILD_HINT = "python -m hf_varrate.calibration --model <your model> --out <dir>"


class BasesError(ValueError):
    """A bases artifact is missing, corrupt, or does not fit the model it meets."""


class Bases:
    """Per-layer orthonormal bases, rows ordered by decreasing singular value.

    Shared by every cache built from it (a deepcopy of a cache never copies its bases).
    """

    def __init__(self, tensors: dict[int, torch.Tensor], metadata: dict):
        self.tensors = {int(i): t for i, t in tensors.items()}
        self.metadata = dict(metadata)
        self._resident: dict[tuple[int, str], torch.Tensor] = {}

    # construction -----------------------------------------------------------------------------------
    @classmethod
    def identity(cls, model_config, dtype: torch.dtype = torch.float32) -> Bases:
        """Full-rank identity basis for every compressed layer (for tests, and anyone without bases yet)."""
        shape = describe(model_config)
        eye = torch.eye(shape.width, dtype=dtype)
        return cls.from_tensors({i: eye for i in shape.compressed_layers}, model_config, calibration="identity")

    @classmethod
    def from_tensors(cls, tensors: dict[int, torch.Tensor], model_config=None, **metadata) -> Bases:
        """Wrap per-layer tensors [R, D]; `model_config` fills in the model's shape fields."""
        meta = dict(metadata)
        if model_config is not None:
            meta = {**shape_metadata(describe(model_config)), **meta}
        some = next(iter(tensors.values()))
        meta.setdefault("rank", int(some.shape[0]))
        meta.setdefault("width", int(some.shape[1]))
        meta.setdefault("compressed_layers", sorted(int(i) for i in tensors))
        return cls(tensors, meta)

    # access -----------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(self.metadata["rank"])

    def for_layer(self, layer_idx: int, device=None) -> torch.Tensor:
        """fp32 [R, D] on `device`, uploaded once per device and then kept resident."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        key = (layer_idx, str(device))
        if key not in self._resident:
            if layer_idx not in self.tensors:
                raise BasesError(f"bases have no tensor for layer {layer_idx}; they cover {sorted(self.tensors)}")
            self._resident[key] = self.tensors[layer_idx].to(device=device, dtype=torch.float32).contiguous()
        return self._resident[key]

    def __deepcopy__(self, memo):
        return self  # immutable, per-model: shared by every copy of every cache

    def __repr__(self):
        return (f"Bases(model_id={self.metadata.get('model_id')!r}, layers={len(self.tensors)}, "
                f"rank={self.metadata.get('rank')}, width={self.metadata.get('width')})")

    # validation -------------------------------------------------------------------------------------
    def validate(self, model_config) -> list[str]:
        """Raise `BasesError` if these bases cannot serve `model_config`; return warnings (e.g. model id)."""
        shape = describe(model_config)
        expected = shape_metadata(shape)
        for name in ("num_layers", "num_kv_heads", "head_dim", "width", "compressed_layers"):
            have, want = self.metadata.get(name), expected[name]
            if have is not None and list_or(have) != list_or(want):
                raise BasesError(
                    f"bases do not fit this model: {name} is {have!r} in the bases but {want!r} in the model; "
                    f"build matching bases with: {BUILD_HINT}"
                )
        for i in shape.compressed_layers:
            t = self.tensors.get(i)
            if t is None:
                raise BasesError(f"bases miss layer {i} (layers.{i}); build complete bases with: {BUILD_HINT}")
            if t.ndim != 2 or t.shape[1] != shape.width or t.shape[0] > shape.width:
                raise BasesError(
                    f"basis of layer {i} has shape {tuple(t.shape)}, expected [R <= {shape.width}, {shape.width}]; "
                    f"build matching bases with: {BUILD_HINT}"
                )
        notes = []
        mine, theirs = self.metadata.get("model_id"), shape.model_id
        if mine and theirs and mine != theirs and self.metadata.get("calibration") != "identity":
            notes.append(f"bases were calibrated on {mine!r} but the model is {theirs!r}; shapes match, so they "
                         f"will be used, but quality may differ")
        return notes

    # files ------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
        from safetensors.torch import save_file

        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"layers.{i}": t.to(dtype).contiguous() for i, t in sorted(self.tensors.items())}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt", "library": "hf_varrate"})
        meta = {**self.metadata, "dtype": str(dtype).removeprefix("torch.")}
        (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, revision=None, cache_dir=None, local_files_only=False,
                        token=None) -> Bases:
        """Load from a local directory holding `bases.safetensors` and `config.json`."""
        from safetensors.torch import load_file

        folder = Path(path)
        weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
        for file in (weights, config):
            if not file.is_file():
                raise BasesError(f"{file} not found; build bases with: {BUILD_HINT}")
        try:
            metadata = json.loads(config.read_text())
            raw = load_file(str(weights))
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise BasesError(f"could not read bases from {folder}: {exc}; rebuild them with: {BUILD_HINT}") from exc
        tensors = {int(name.split(".")[1]): t for name, t in raw.items() if name.startswith("layers.")}
        return cls(tensors, metadata)


def shape_metadata(shape: ModelShape) -> dict:
    return {
        "model_id": shape.model_id,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "width": shape.width,
        "compressed_layers": list(shape.compressed_layers),
    }


def list_or(value):
    return list(value) if isinstance(value, (list, tuple)) else value
