"""Moving a bases artifact to and from the Hugging Face Hub: download (snapshot) and upload.

Transport only: what an artifact holds and how it is checked is `hf_varrate.bases`' business.
Downloads go through `huggingface_hub.snapshot_download`, so the HF cache, `HF_HUB_OFFLINE=1`,
`HF_ENDPOINT`, pinned revisions and tokens behave as they do for any model. Only the three
artifact files are fetched or uploaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from .bases_checks import ARTIFACT_FILES, BUILD_HINT, CONFIG_NAME, WEIGHTS_NAME
from .errors import BasesError
from .version import __version__


def download_bases(repo_id: str, *, revision: str | None = None, cache_dir=None, local_files_only: bool = False,
                   token: str | bool | None = None) -> Path:
    """The local folder of a Hub bases repo at `revision` (branch, tag or commit), downloaded if needed."""
    from huggingface_hub import snapshot_download

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


def upload_folder(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                  revision: str | None = None, token: str | bool | None = None, commit_message: str):
    """Upload a staged artifact folder's three files to `repo_id` (created if missing); `revision` is a
    branch, created from main if it does not exist. Returns what `HfApi.upload_folder` returns."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                             commit_message=commit_message, allow_patterns=list(ARTIFACT_FILES))
