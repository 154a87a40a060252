"""`Bases`: the per-layer PCA bases V [R, D] of one model, and their on-disk artifact.

Artifact (a local directory or a Hub repo), three plain files:

- `bases.safetensors`: tensor `layers.<i>` [R, D] per compressed layer (fp16, bf16 or fp32) and,
  optionally for all of those layers or none, `spectrum.<i>` [R] (fp32): the calibration's singular
  values, descending, one per basis row (older artifacts have none);
- `config.json`: sorted keys, see `Bases.metadata`, plus `sha256` of the tensor file, checked on load;
- `README.md`: a model card rendered from `hf_varrate/hub_assets/model_card.md`.

Only safetensors and JSON are ever read: no pickle, no `torch.load`, no remote code.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import uuid
from pathlib import Path

import torch

from .architecture import ModelShape, describe
from .bases_checks import (  # noqa: F401 (re-exported: the artifact's names and checks live there)
    BUILD_HINT,
    CONFIG_NAME,
    FLOAT_DTYPES,
    INT_FIELDS,
    WEIGHTS_NAME,
    BasesError,
    build_hint,
    check_basis,
    check_metadata,
    check_spectrum,
    check_tensors,
)

CARD_NAME = "README.md"
ARTIFACT_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)
FORMAT_VERSION = 1  # spectrum.<i> is optional, so artifacts with and without it share version 1
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB; anything larger is not ours
SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "width", "compressed_layers")


class Bases:
    """Per-layer orthonormal bases, rows ordered by decreasing singular value.

    Shared by every cache built from it (a deepcopy of a cache never copies its bases).
    `metadata` holds the model's shape (num_layers, num_kv_heads, head_dim, width,
    compressed_layers), rank, model_id, and the calibration settings (stride, window, n_anchors...).
    `spectra` (possibly empty) holds each layer's calibration singular values, fp32 [R], descending.
    """

    def __init__(self, tensors: dict[int, torch.Tensor], metadata: dict,
                 spectra: dict[int, torch.Tensor] | None = None):
        self.tensors = {int(i): t for i, t in tensors.items()}
        self.metadata = dict(metadata)
        # fp32 on the CPU from the start, so what is in memory is what a save and a load give back
        self.spectra = {int(i): s.detach().to("cpu", torch.float32).contiguous() for i, s in (spectra or {}).items()}
        self._resident: dict[tuple[int, str], torch.Tensor] = {}

    # construction -----------------------------------------------------------------------------------
    @classmethod
    def identity(cls, model_config, dtype: torch.dtype = torch.float32) -> Bases:
        """Full-rank identity basis for every compressed layer (for tests, and anyone without bases yet)."""
        shape = describe(model_config)
        eye = torch.eye(shape.width, dtype=dtype)
        return cls.from_tensors({i: eye for i in shape.compressed_layers}, model_config, calibration="identity")

    @classmethod
    def from_tensors(cls, tensors: dict[int, torch.Tensor], model_config=None,
                     spectra: dict[int, torch.Tensor] | None = None, **metadata) -> Bases:
        """Wrap per-layer tensors [R, D] and, optionally, their singular values [R] (`spectra`, for
        every layer or none); `model_config` fills in the model's shape fields."""
        meta = dict(metadata)
        if model_config is not None:
            meta = {**shape_metadata(describe(model_config)), **meta}
        some = next(iter(tensors.values()))
        meta.setdefault("rank", int(some.shape[0]))
        meta.setdefault("width", int(some.shape[1]))
        meta.setdefault("compressed_layers", sorted(int(i) for i in tensors))
        return cls(tensors, meta, spectra)

    # access -----------------------------------------------------------------------------------------
    @property
    def calibrated_settings(self) -> dict:
        """The codec settings the bases were calibrated with (stride, window, n_anchors; those recorded):
        the defaults a cache coding with them should use."""
        return {k: self.metadata[k] for k in ("stride", "window", "n_anchors") if k in self.metadata}

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

    def spectrum(self, layer_idx: int, device=None) -> torch.Tensor | None:
        """fp32 [R] calibration singular values of layer `layer_idx` (descending, row i of the basis has
        the i-th), or None when these bases carry no spectrum (identity bases, older artifacts)."""
        if layer_idx not in self.tensors:
            raise BasesError(f"bases have no tensor for layer {layer_idx}; they cover {sorted(self.tensors)}")
        if not self.spectra:
            return None
        if layer_idx not in self.spectra:  # only unchecked bases built in memory can get here
            raise BasesError(f"bases carry a spectrum for layers {sorted(self.spectra)} but not for layer "
                             f"{layer_idx}; pass spectra for every layer or none")
        return self.spectra[layer_idx].to(device or "cpu")

    def __deepcopy__(self, memo):
        return self  # immutable, per-model: shared by every copy of every cache

    def __repr__(self):
        return (f"Bases(model_id={self.metadata.get('model_id')!r}, layers={len(self.tensors)}, "
                f"rank={self.metadata.get('rank')}, width={self.metadata.get('width')})")

    # validation -------------------------------------------------------------------------------------
    def validate(self, model_config) -> list[str]:
        """Raise `BasesError` if these bases cannot serve `model_config`; return warnings (e.g. model id).

        Shapes must match exactly; a different model id with matching shapes is only a warning (a
        fine-tune of the calibrated model is a legitimate use). A model loaded from a local folder
        has no Hub id to compare, so it is not warned about.
        """
        shape = describe(model_config)
        expected = shape_metadata(shape)
        hint = build_hint(shape.model_id)
        for name in SHAPE_FIELDS:
            have, want = self.metadata.get(name), expected[name]
            if have is not None and list_or(have) != list_or(want):
                raise BasesError(f"bases do not fit this model: {name} is {have!r} in the bases but {want!r} in "
                                 f"the model; build matching bases with: {hint}")
        for i in shape.compressed_layers:
            t = self.tensors.get(i)
            if t is None:
                raise BasesError(f"bases miss layer {i} (tensor layers.{i}); build complete bases with: {hint}")
            if t.ndim != 2 or t.shape[1] != shape.width or t.shape[0] > shape.width:
                raise BasesError(f"basis of layer {i} has shape {tuple(t.shape)}, expected [R <= {shape.width}, "
                                 f"{shape.width}]; build matching bases with: {hint}")
        notes = []
        mine, theirs = self.metadata.get("model_id"), shape.model_id
        comparable = mine and theirs and not os.path.isdir(str(theirs))
        if comparable and mine != theirs and self.metadata.get("calibration") != "identity":
            notes.append(f"bases were calibrated on {mine!r} but the model is {theirs!r}; shapes match, so they "
                         f"will be used, but quality may differ")
        return notes

    def check(self) -> None:
        """Raise `BasesError` unless every tensor is a finite float [rank, width] with orthonormal rows,
        the tensors cover exactly `compressed_layers`, and spectra (if any) are valid for all of them."""
        meta = check_metadata(self.metadata)
        expected = set(meta["compressed_layers"])
        if set(self.tensors) != expected:
            missing, extra = sorted(expected - set(self.tensors)), sorted(set(self.tensors) - expected)
            raise BasesError(f"bases tensors do not match compressed_layers {sorted(expected)}: missing layers "
                             f"{missing}, unexpected layers {extra}; rebuild them with: {build_hint(meta)}")
        check_tensors(self._named_tensors(), meta)  # each basis; spectra for all layers or none

    # files ------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype = torch.float16,
                        card: bool = True) -> Path:
        """Write `bases.safetensors`, `config.json` (with the tensor file's sha256) and a `README.md` card."""
        from safetensors.torch import save

        self.check()
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = self._named_tensors(dtype)
        blob = save(tensors, metadata={"format": "pt", "library": "hf_varrate"})
        check_tensors(tensors, self.metadata)  # what fp16 rounding left must still be a valid basis
        from . import __version__

        meta = {**self.metadata, "dtype": str(dtype).removeprefix("torch."), "format_version": FORMAT_VERSION,
                "library_version": __version__, "sha256": {WEIGHTS_NAME: hashlib.sha256(blob).hexdigest()}}
        _write_atomic(out / WEIGHTS_NAME, blob)
        _write_atomic(out / CONFIG_NAME, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
        if card:
            from .hub import render_card

            _write_atomic(out / CARD_NAME, render_card(meta, spectrum=bool(self.spectra)).encode())
        return out

    def _named_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensor file's contents: `layers.<i>` in `dtype` (default: as held), `spectrum.<i>` in fp32."""
        tensors = {f"layers.{i}": t.detach().to("cpu", dtype or t.dtype, copy=True).contiguous()
                   for i, t in sorted(self.tensors.items())}  # copies: identity layers share one tensor
        tensors.update({f"spectrum.{i}": s.clone() for i, s in sorted(self.spectra.items())})
        return tensors

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, revision: str | None = None,
                    token: str | None = None, commit_message: str | None = None):
        """Save to a temporary folder and upload it (`HfApi.create_repo` + `upload_folder`)."""
        from .hub import push_folder

        with tempfile.TemporaryDirectory(prefix="hf_varrate-bases-") as folder:
            self.save_pretrained(folder)
            return push_folder(folder, repo_id, private=private, revision=revision, token=token,
                               commit_message=commit_message)

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, revision=None, cache_dir=None,
                        local_files_only=False, token=None) -> Bases:
        """Load from a local directory, else from the Hub (`huggingface_hub.snapshot_download`: works
        offline from the HF cache, `revision` may be a branch, tag or commit). Always verified."""
        folder = Path(path_or_repo_id).expanduser()
        if not folder.is_dir():
            if looks_local(str(path_or_repo_id)):
                raise BasesError(f"{path_or_repo_id} is not a directory holding bases ({WEIGHTS_NAME}, "
                                 f"{CONFIG_NAME}); build bases there with: {BUILD_HINT}")
            from .hub import download_bases

            folder = download_bases(str(path_or_repo_id), revision=revision, cache_dir=cache_dir,
                                    local_files_only=local_files_only, token=token)
        return read_artifact(folder)


def read_artifact(folder: str | os.PathLike) -> Bases:
    """Read and verify a bases folder: JSON config, sha256 of the tensor file, then every tensor."""
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
    return Bases(tensors, metadata, spectra)


def shape_metadata(shape: ModelShape) -> dict:
    return {
        "model_id": shape.model_id,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "width": shape.width,
        "compressed_layers": list(shape.compressed_layers),
    }


def looks_local(path: str) -> bool:
    """True for strings that can only be a filesystem path, never a Hub repo id ("name" or "org/name")."""
    return (path.startswith(("/", ".", "~")) or "\\" in path or path.count("/") > 1 or os.path.exists(path))


def list_or(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _read_config(path: Path):
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise BasesError(f"{path} is {path.stat().st_size} bytes, more than a bases config can be "
                         f"({MAX_CONFIG_BYTES}); rebuild it with: {BUILD_HINT}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BasesError(f"{path} is not valid JSON ({type(exc).__name__}: {exc}); rebuild it with: "
                         f"{BUILD_HINT}") from exc


def _write_atomic(path: Path, data: bytes) -> None:
    """Write beside `path` and rename into place, so a reader never sees half a file (mode per umask)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
