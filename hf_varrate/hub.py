"""Bases on the Hugging Face Hub: download (snapshot), upload (create_repo + upload_folder), model card.

Downloads go through `huggingface_hub.snapshot_download`, so the HF cache, `HF_HUB_OFFLINE=1`,
`HF_ENDPOINT`, pinned revisions and tokens behave as they do for any model. Only the three
artifact files are fetched or uploaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from string import Template

from .bases import ARTIFACT_FILES, BUILD_HINT, CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, BasesError, read_artifact

CARD_TAGS = ["hf_varrate", "varrate", "kv-cache", "kv-cache-compression", "long-context"]


def download_bases(repo_id: str, *, revision: str | None = None, cache_dir=None, local_files_only: bool = False,
                   token: str | bool | None = None) -> Path:
    """The local folder of a Hub bases repo at `revision` (branch, tag or commit), downloaded if needed."""
    from huggingface_hub import snapshot_download

    from . import __version__

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                   local_files_only=local_files_only, token=token,
                                   allow_patterns=list(ARTIFACT_FILES), library_name="hf_varrate",
                                   library_version=__version__)
    except Exception as exc:  # the Hub client raises many types (HTTP, offline, validation, OS)
        cached = _cached_snapshot(repo_id, revision, cache_dir)
        if cached is not None:
            return cached
        raise BasesError(
            f"{repo_id!r} is not a local directory, and getting it from the Hub (revision {revision or 'main'}) "
            f"failed: {type(exc).__name__}: {exc}. Pass a folder that holds {WEIGHTS_NAME} and {CONFIG_NAME}, "
            f"or a Hub repo id (offline: download it once, then HF_HUB_OFFLINE=1 reads the HF cache), or build "
            f"bases with: {BUILD_HINT}"
        ) from exc
    return Path(folder)


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir) -> Path | None:
    """The HF-cache folder of `revision` if both artifact files are there, else None.

    huggingface_hub < 2 cannot resolve a commit hash offline unless a ref points at it, although
    the cache holds snapshots/<commit>/; a pinned revision must load offline on every version.
    """
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        paths = [try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=revision)
                 for name in (WEIGHTS_NAME, CONFIG_NAME)]
    except HFValidationError:  # not a valid repo id: the caller reports the download's own error
        return None
    return Path(paths[0]).parent if all(isinstance(p, str) for p in paths) else None


def push_folder(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                revision: str | None = None, token: str | bool | None = None, commit_message: str | None = None):
    """Verify a bases folder, then upload its three files to `repo_id` (created if missing).

    The card's usage snippet is re-rendered to name `repo_id`; `config.json` and the tensors are
    uploaded byte for byte. `revision` is a branch, created from main if it does not exist.
    Returns what `HfApi.upload_folder` returns (the commit info).
    """
    from huggingface_hub import HfApi

    bases = read_artifact(folder)  # never upload something that would not load
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_varrate-push-") as staging:
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            shutil.copyfile(Path(folder) / name, Path(staging) / name)
        (Path(staging) / CARD_NAME).write_text(render_card(bases.metadata, bases_ref=repo_id,
                                                           spectrum=bool(bases.spectra)))
        return api.upload_folder(
            repo_id=repo_id, folder_path=staging, repo_type="model", revision=revision,
            commit_message=commit_message or f"Upload VarRate bases for {bases.metadata.get('model_id')}",
            allow_patterns=list(ARTIFACT_FILES),
        )


def render_card(metadata: dict, bases_ref: str | None = None, spectrum: bool = False) -> str:
    """The README.md model card of a bases artifact, from the template shipped as package data;
    `spectrum`: whether the tensor file also holds the calibration singular values."""
    from huggingface_hub import ModelCardData

    model_id = metadata.get("model_id")
    hub_id = model_id if isinstance(model_id, str) and _is_repo_id(model_id) else None
    card_data = ModelCardData(base_model=hub_id, library_name="hf_varrate", license=metadata.get("license"),
                              tags=CARD_TAGS)
    template = Template(resources.files("hf_varrate").joinpath("hub_assets/model_card.md").read_text("utf-8"))
    return template.safe_substitute(
        card_data=card_data.to_yaml(),
        model_name=model_id or "<model>",
        bases_ref=bases_ref or metadata.get("bases_ref") or "path/or/repo-id/of/these/bases",
        shape_table=_shape_table(metadata, spectrum),
        calibration_section=_calibration_section(metadata),
        quality_section=_quality_section(metadata),
        build_command=metadata.get("build_command") or BUILD_HINT,
    )


def _shape_table(meta: dict, spectrum: bool = False) -> str:
    sha = (meta.get("sha256") or {}).get(WEIGHTS_NAME, "(written on save)")
    rows = [
        ("model", f"`{meta.get('model_id')}`" + (f" ({meta['model_revision']})" if meta.get("model_revision") else "")),
        ("layers; compressed (full attention)", f"{meta.get('num_layers')}; {meta.get('compressed_layers')}"),
        ("KV heads H, head dim d, width D = 2Hd", f"{meta.get('num_kv_heads')}, {meta.get('head_dim')}, "
                                                   f"{meta.get('width')}"),
        ("basis rank R", meta.get("rank")),
        ("anchor stride, exact window, nearest anchors", f"{meta.get('stride')}, {meta.get('window')}, "
                                                         f"{meta.get('n_anchors')}"),
        (f"tensors in {WEIGHTS_NAME}", f"`layers.<i>` [R, D] {meta.get('dtype')} (the basis V of layer i)"
                                        + ("; `spectrum.<i>` [R] float32 (its calibration singular values, "
                                           "descending, one per row of V)" if spectrum else "")),
        (f"sha256 of {WEIGHTS_NAME}", f"`{sha}`"),
        ("hf_varrate version", meta.get("library_version")),
    ]
    return "\n".join(f"| {name} | {value} |" for name, value in rows)


def _calibration_section(meta: dict) -> str:
    if meta.get("calibration") == "identity":
        return "None: identity bases (every layer's V is the identity), a baseline."
    lines = [
        f"- data: {meta.get('calibration', 'not recorded')}",
        f"- contexts: {meta.get('num_contexts')} x {meta.get('context_length')} tokens, seed {meta.get('seed')}",
        f"- residual vectors per layer: {meta.get('num_samples')} (the coded tokens, as the cache codes them)",
        "- method: fp64 second moment of the residuals per layer, top-R eigenvectors (= right singular "
        "vectors), sign fixed so each row's largest-magnitude entry is positive",
    ]
    if meta.get("calibration_seconds") is not None:
        lines.append(f"- time: {meta['calibration_seconds']:.1f} s on {meta.get('calibration_machine', 'CPU')}")
    return "\n".join(lines)


def _quality_section(meta: dict) -> str:
    quality = meta.get("quality")
    if not quality:
        return "Not measured for this artifact."
    head = (
        f"Relative reconstruction error of the codec at budget {quality['budget']} on held-out text "
        f"({quality['data']}; {quality['num_contexts']} contexts x {quality['context_length']} tokens, none of it "
        f"used for calibration): ||K^ - K||_F / ||K||_F over the coded (non-exact) tokens of each compressed "
        f"layer, then the mean over layers; the same for V. The exact K/V come from a `DynamicCache` on the same "
        f"input. Lower is better.\n\n"
        "| basis | keys | values | footprint (fraction of full K/V) |\n|---|---|---|---|"
    )
    rows = [f"| {label} | {quality[key]['keys']:.4f} | {quality[key]['values']:.4f} | "
            f"{quality[key]['footprint']:.4f} |"
            for key, label in (("calibrated", "these bases"), ("identity", "identity basis (no calibration)"))
            if key in quality]
    return "\n".join([head, *rows])


def _is_repo_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not os.path.isabs(name) and not name.startswith(".")
