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
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from .architecture import ModelShape, check_compressible, describe
from .bases_checks import (  # noqa: F401 (re-exported: the artifact's names and checks live there)
    ARTIFACT_FILES,
    BUILD_HINT,
    CARD_NAME,
    CONFIG_NAME,
    FLOAT_DTYPES,
    FORMAT_VERSION,
    INT_FIELDS,
    WEIGHTS_NAME,
    build_hint,
    check_basis,
    check_metadata,
    check_spectrum,
    check_tensors,
    check_fits_model,
    layout_metadata,
    looks_local,
    read_files,
    shape_metadata,
)
from .card import render_card, tensor_header
from .config import LOW_BUDGET_KEY, VarRateConfig
from .config_checks import component_or_token, fall_back
from .errors import BasesError, CalibrationOverrideWarning
from .files import replacing_folder
from .hub import check_subfolder, download_files, snapshot_commit, upload_files
from .rotary import RotaryFrequencies
from .spaces import CodingSpaces
from .shipped import shipped_path
from .stored import StoredTensors
from .version import __version__



class Bases:
    """Per-layer orthonormal bases, rows ordered by decreasing singular value.

    Shared by every cache built from it (a deepcopy of a cache never copies its bases).
    `metadata` holds the model's shape (num_layers, num_kv_heads, head_dim, width,
    compressed_layers), rank, model_id, and the calibration settings (stride, window, n_anchors...).
    `spectra` (possibly empty) holds each layer's calibration singular values, fp32 [R], descending.
    `tensors` maps each compressed layer to its stored basis (`StoredTensors`: read from a file, a layer whose
    coding copy exists is read again from the file when needed, not held twice).
    """

    def __init__(self, tensors: dict[int, torch.Tensor] | StoredTensors, metadata: dict,
                 spectra: dict[int, torch.Tensor] | None = None):
        self.tensors = tensors if isinstance(tensors, StoredTensors) else StoredTensors(tensors)
        self.metadata = dict(metadata)
        # fp32 on the CPU from the start, so what is in memory is what a save and a load give back
        self.spectra = {int(i): s.detach().to("cpu", torch.float32).contiguous() for i, s in (spectra or {}).items()}
        self.spaces = CodingSpaces(self)  # what coding and reading derive from the stored tensors, kept
        # where `from_pretrained` read them (an absolute folder or a Hub repo id, its revision and subfolder):
        # a saved cache records it, to read the same bases again from any working directory
        self.source: str | None = None
        self.revision: str | None = None
        self.subfolder: str | None = None
        self.commit: str | None = None  # the commit `revision` resolved to on the Hub, when it came from there

    # construction -----------------------------------------------------------------------------------
    @classmethod
    def identity(cls, model_config, dtype: torch.dtype = torch.float32) -> Bases:
        """Full-rank identity basis for every compressed layer (for tests, and anyone without bases yet)."""
        shape = check_compressible(describe(model_config))
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

    def tuned_settings(self, preset: str, low_budget: bool = False) -> dict:
        """Settings chosen for this model on a development split and confirmed on a held-out one, that `preset`
        takes with these bases (the artifact's `presets` field, e.g. {"recommended": {"key_weight": 4.0}}); with
        `low_budget` (a budget at which the preset takes its low-budget settings) also those of its `low_budget`
        entry, e.g. {"recommended": {"key_weight": 4.0, "low_budget": {"coef_scales": "component"}}}."""
        tuned = self.metadata.get("presets", {})
        settings = dict(tuned.get(preset, {})) if isinstance(tuned, dict) else {}
        low = settings.pop(LOW_BUDGET_KEY, {})
        return {**settings, **low} if low_budget else settings

    def config(self, preset: str = "recommended", *, stacklevel: int = 2, **overrides) -> VarRateConfig:
        """The config a cache coding with these bases uses: `preset`'s defaults ('recommended' or 'paper'),
        the calibration settings (stride, window, n_anchors), the settings tuned for this model
        (`tuned_settings`), then `overrides`. The one way every
        caller (the cache, the kvpress press, the evaluation harness) builds a config. Three rules, each
        announced with a VarRateWarning:

        - an override of a calibration setting is kept, with a warning (the residuals then follow other
          statistics than the basis was fitted to);
        - the 'recommended' preset's balance='rms' needs the calibration spectrum; with bases that carry
          none (identity bases, older artifacts) it falls back to balance='none' instead of failing at
          the prefill. Passing balance= explicitly turns this rule off. Likewise its layer_budgets='measured'
          (at budgets of 0.1 or less) falls back to 'uniform' on bases that carry no measurement
          (`config_checks.fall_back`);
        - a tuned coef_scales='component' gives way to 'token' where the overrides rule it out (e.g. signal=
          'snapkv': per-component scales fit tokens of one rank), rather than failing on a field the user never
          set. Passing coef_scales= explicitly turns this rule off.
        """
        calibrated = self.calibrated_settings
        changed = {k: v for k, v in overrides.items() if k in calibrated and v != calibrated[k]}
        if changed:
            warnings.warn(
                f"{changed} differ from the values these bases were calibrated with "
                f"({ {k: calibrated[k] for k in changed} }); the residuals then follow other statistics than the "
                f"basis was fitted to. Recalibrate with the same settings (hf-varrate calibrate --stride ...) to "
                f"match them", CalibrationOverrideWarning, stacklevel=stacklevel)
        low = VarRateConfig.low_budget_settings(preset, overrides)  # the preset's own, over the calibrated window
        tuned = self.tuned_settings(preset, low_budget=bool(low))
        settings = {**calibrated, **low, **tuned, **overrides}
        if tuned.get("coef_scales") == "component" and "coef_scales" not in overrides:
            as_token = VarRateConfig.preset(preset, **{**settings, "coef_scales": "token"})
            settings["coef_scales"] = component_or_token(as_token, preset, stacklevel=stacklevel + 1)
        config = VarRateConfig.preset(preset, **settings)
        return fall_back(config, preset, overrides, spectrum=bool(self.spectra),
                         measured=bool(self.metadata.get("layer_sensitivity")), stacklevel=stacklevel + 1)

    @property
    def rank(self) -> int:
        return int(self.metadata["rank"])

    def model_shape(self) -> ModelShape:
        """The model's layer layout as these bases record it: what a cache built without the model needs."""
        meta = self.metadata
        layers = list(meta.get("compressed_layers", []))
        if "sliding_window" not in meta and len(layers) < meta.get("num_layers", 0):
            raise BasesError(f"these bases do not record the model's sliding window (written by hf_varrate < 0.2): "
                             f"pass model=model, or re-save them with this version: {build_hint(meta)}")
        return ModelShape(num_layers=meta["num_layers"], num_kv_heads=meta["num_kv_heads"], head_dim=meta["head_dim"],
                          compressed_layers=tuple(layers), sliding_window=meta.get("sliding_window"),
                          model_id=meta.get("model_id"))

    def rope(self) -> RotaryFrequencies | None:
        """The compressed layers' rotary frequencies as recorded at calibration (None: not recorded)."""
        recorded = (self.metadata.get("rope") or {}).get("full_attention")
        return RotaryFrequencies.from_metadata(recorded) if recorded else None

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

    # coding spaces: derived once and kept (`hf_varrate.spaces`) ------------------------------------
    def for_layer(self, layer_idx: int, device=None) -> torch.Tensor:
        """[R, D] on `device` in the stored dtype, uploaded once per device and then kept resident."""
        return self.spaces.basis(layer_idx, device)

    def coding_basis(self, layer_idx: int, balance: str, device=None, key_weight: float = 1.0,
                     bits: int | None = VarRateConfig.basis_bits):
        """(basis [R, D] in the stored dtype, half scales [D] fp32 or None) a layer codes with, its copy held in
        `bits` (8, or None: the stored dtype; by default what a default cache codes with, so this shares its
        copy): `CodingSpaces.coding_basis`."""
        return self.spaces.coding_basis(layer_idx, balance, device, key_weight, bits)

    def attention_basis(self, layer_idx: int, balance: str, device, heads: int, dim: int, key_weight: float = 1.0,
                        bits: int | None = VarRateConfig.basis_bits):
        """The coding basis as attention over the codes reads it: `CodingSpaces.attention_basis`."""
        return self.spaces.attention_basis(layer_idx, balance, device, heads, dim, key_weight, bits)

    def layer_share(self, layer_idx: int, config: VarRateConfig, kv_dtype: torch.dtype | None = None):
        """What `compress_prompt(layer_share=...)` takes for this layer: `CodingSpaces.layer_share`."""
        return self.spaces.layer_share(layer_idx, config, kv_dtype)

    def nbytes(self) -> int:
        """Bytes of every tensor these bases hold, stored and derived (a per-model cost, shared by every cache)."""
        return self.spaces.nbytes()

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
        return check_fits_model(self.metadata, self.tensors, model_config)

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
        """Write `bases.safetensors`, `config.json` (with the tensor file's sha256) and a `README.md` card,
        replacing a previous artifact in `save_directory` as a whole (`files.replacing_folder`): on any
        error, nothing there has changed."""
        from safetensors.torch import save

        self.check()
        tensors = self._named_tensors(dtype)
        blob = save(tensors, metadata=tensor_header("bases", self.metadata.get("model_id"), FORMAT_VERSION,
                                                    rank=self.metadata.get("rank")))
        check_tensors(tensors, self.metadata)  # what fp16 rounding left must still be a valid basis
        meta = {**self.metadata, "dtype": str(dtype).removeprefix("torch."), "format_version": FORMAT_VERSION,
                "library_version": __version__, "sha256": {WEIGHTS_NAME: hashlib.sha256(blob).hexdigest()}}
        files = {WEIGHTS_NAME: blob, CONFIG_NAME: (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()}
        if card:
            files[CARD_NAME] = render_card(meta, spectrum=bool(self.spectra)).encode()
        with replacing_folder(save_directory, ARTIFACT_FILES, "bases artifact") as folder:  # all files or none
            for name, data in files.items():
                with open(folder / name, "xb") as handle:
                    handle.write(data)
        return Path(save_directory)

    def _named_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensor file's contents: `layers.<i>` in `dtype` (default: as held), `spectrum.<i>` in fp32."""
        tensors = {f"layers.{i}": t.detach().to("cpu", dtype or t.dtype, copy=True).contiguous()
                   for i, t in sorted(self.tensors.items())}  # copies: identity layers share one tensor
        tensors.update({f"spectrum.{i}": s.clone() for i, s in sorted(self.spectra.items())})
        return tensors

    def push_to_hub(self, repo_id: str, *, subfolder: str | None = None, private: bool | None = None,
                    revision: str | None = None, token: str | bool | None = None, commit_message: str | None = None,
                    create_pr: bool = False):
        """Save to a temporary folder and upload it as one commit (`push_folder`); returns the `CommitInfo`."""
        with tempfile.TemporaryDirectory(prefix="hf_varrate-bases-") as folder:
            self.save_pretrained(folder)
            return push_folder(folder, repo_id, subfolder=subfolder, private=private, revision=revision, token=token,
                               commit_message=commit_message, create_pr=create_pr)

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, revision: str | None = None, cache_dir=None,
                        local_files_only: bool = False, token: str | bool | None = None, *,
                        subfolder: str | None = None, force_download: bool = False) -> Bases:
        """Load the shipped bases of that name (`hf_varrate.shipped.SHIPPED`), else from a local directory
        (its `subfolder`), else from a Hub repo (`huggingface_hub.snapshot_download`; the standard arguments:
        `revision` a branch, tag, commit or refs/pr/N, `subfolder`, `cache_dir`, `force_download`,
        `local_files_only`, `token`; offline it reads the HF cache). Always verified (sha256, every tensor)."""
        subfolder = check_subfolder(subfolder)
        shipped = None if subfolder else shipped_path(path_or_repo_id)
        if shipped is not None:  # recorded by name, which resolves in any installation
            bases = read_artifact(shipped)
            bases.source = str(path_or_repo_id)
            return bases
        root = Path(path_or_repo_id).expanduser()
        folder = root / subfolder if subfolder else root
        if folder.is_dir():
            bases = read_artifact(folder)
            bases.source = str(folder.resolve())
            return bases
        if looks_local(str(path_or_repo_id)):
            raise BasesError(f"{folder} is not a directory holding bases ({WEIGHTS_NAME}, {CONFIG_NAME}); build "
                             f"bases there with: {BUILD_HINT}")
        folder = download_files(str(path_or_repo_id), ARTIFACT_FILES, required=(WEIGHTS_NAME, CONFIG_NAME),
                                error=BasesError, hint=_PULL_HINT, subfolder=subfolder, revision=revision,
                                cache_dir=cache_dir, force_download=force_download,
                                local_files_only=local_files_only, token=token)
        bases = read_artifact(folder)
        bases.source, bases.revision, bases.subfolder = str(path_or_repo_id), revision, subfolder
        bases.commit = snapshot_commit(folder)
        return bases


_PULL_HINT = (f"Pass a folder that holds {WEIGHTS_NAME} and {CONFIG_NAME}, the name of shipped bases, or a Hub repo "
              f"id, or build bases with: {BUILD_HINT}")


def read_artifact(folder: str | os.PathLike) -> Bases:
    """Read and verify a bases folder (`bases_checks.read_files`) into a `Bases` whose stored tensors are read
    again from that file when needed (`StoredTensors`)."""
    tensors, metadata, spectra = read_files(folder)
    return Bases(StoredTensors(tensors, (Path(folder) / WEIGHTS_NAME).resolve()), metadata, spectra)


def push_folder(folder: str | os.PathLike, repo_id: str, *, subfolder: str | None = None,
                private: bool | None = None, revision: str | None = None, token: str | bool | None = None,
                commit_message: str | None = None, create_pr: bool = False):
    """Verify a bases folder, then upload its three files to `repo_id` (created if missing) as one commit,
    into `subfolder` if given (several models' bases can share a repo).

    The card's usage snippet is re-rendered to name `repo_id`; `config.json` and the tensors are
    uploaded byte for byte. `revision` is a branch, created from main if it does not exist;
    `create_pr=True` opens a pull request instead (its `refs/pr/N` is `.pr_revision` of the result).
    Returns `HfApi.create_commit`'s `CommitInfo`.
    """
    bases = read_artifact(folder)  # never upload something that would not load
    with tempfile.TemporaryDirectory(prefix="hf_varrate-push-") as staging:
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            shutil.copyfile(Path(folder) / name, Path(staging) / name)
        (Path(staging) / CARD_NAME).write_text(render_card(
            bases.metadata, bases_ref=repo_id, spectrum=bool(bases.spectra), subfolder=check_subfolder(subfolder)))
        message = commit_message or f"Upload VarRate bases for {bases.metadata.get('model_id')}"
        return upload_files(staging, repo_id, ARTIFACT_FILES, subfolder=subfolder, private=private,
                            revision=revision, token=token, commit_message=message, create_pr=create_pr)
