"""Moving an artifact (a bases folder, a saved cache) to and from a Hugging Face Hub repo.

Transport only: what an artifact holds and how it is checked is the business of `hf_varrate.bases`
and `hf_varrate.serialization`. They hand this module the names of their files, and check the folder
it hands back exactly as they check a local one (sha256 of every tensor file and all), so a pull is
verified like a local load, and a push uploads only a folder that loads.

Downloads go through `huggingface_hub.snapshot_download`, so the HF cache, `HF_HUB_OFFLINE=1`,
`HF_ENDPOINT`, pinned revisions (branch, tag, commit or `refs/pr/N`) and tokens behave as they do for
any model; only the artifact's files are fetched. Uploads are one `HfApi.create_commit` of those files
(the repo created if missing, a `revision` branch created from main if missing, or a pull request
with `create_pr=True`). The arguments are the standard ones of `from_pretrained` / `push_to_hub` in
transformers and huggingface_hub: `revision`, `subfolder`, `cache_dir`, `force_download`,
`local_files_only`, `token`; `private`, `commit_message`, `create_pr`.

Any other storage an fsspec URL names (`s3://bucket/docs/doc-1`, `gs://...`, `file:///srv/docs`,
`memory://...`) is reached through `fsspec` (the `fsspec` extra, plus the filesystem's own package such
as s3fs): `put_files` copies a saved folder's files there, the JSON last, and `fetched` copies them back
into a temporary folder for the same checks.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from .version import __version__


def check_subfolder(subfolder) -> str | None:
    """`subfolder` as a relative POSIX path inside a repo ('' and None: the repo's root), or a ValueError."""
    if subfolder is None or subfolder == "":
        return None
    parts = PurePosixPath(subfolder).parts if isinstance(subfolder, str) else ()
    if not parts or subfolder.startswith("/") or "\\" in subfolder or any(p in (".", "..") for p in parts):
        raise ValueError(f"subfolder must be a relative path inside the repo such as 'bases' or 'docs/report', "
                         f"got {subfolder!r}; pass subfolder=None for the repo's root")
    return "/".join(parts)


def download_files(repo_id: str, names: tuple[str, ...], *, required: tuple[str, ...], error: type[Exception],
                   hint: str, subfolder: str | None = None, revision: str | None = None, cache_dir=None,
                   force_download: bool = False, local_files_only: bool = False,
                   token: str | bool | None = None) -> Path:
    """The local folder holding the files `names` of `repo_id` at `revision` (in `subfolder`), downloaded
    into the HF cache if needed. Raises `error` (the artifact's own error type) with `hint` when the
    download fails and the cache cannot serve it, or when a `required` file is not in the repo."""
    from huggingface_hub import snapshot_download

    subfolder = check_subfolder(subfolder)
    prefix = f"{subfolder}/" if subfolder else ""
    where = f"revision {revision or 'main'}" + (f", subfolder {subfolder!r}" if subfolder else "")
    try:
        root = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, force_download=force_download,
                                 local_files_only=local_files_only, token=token,
                                 allow_patterns=[prefix + name for name in names], library_name="hf_varrate",
                                 library_version=__version__)
    except Exception as exc:  # the Hub client raises many types (HTTP, offline, validation, OS)
        cached = None if force_download else _cached_snapshot(repo_id, prefix, required, revision, cache_dir)
        if cached is not None:
            return cached
        raise error(f"{repo_id!r} is not a local directory, and getting it from the Hub ({where}) failed: "
                    f"{type(exc).__name__}: {exc}. {hint} (offline: download it once, then HF_HUB_OFFLINE=1 "
                    f"or local_files_only=True reads the HF cache)") from exc
    folder = Path(root) / subfolder if subfolder else Path(root)
    missing = [name for name in required if not (folder / name).is_file()]
    if missing:
        raise error(f"the Hub repo {repo_id!r} ({where}) holds no {' or '.join(missing)}: is it the right repo, "
                    f"revision and subfolder? {hint}")
    return folder


def snapshot_commit(folder: Path) -> str | None:
    """The commit a downloaded folder was read at: the HF cache keeps each one under snapshots/<commit>/ (what a
    branch or tag resolved to at download time). None for a folder outside that layout."""
    for part in (folder, *folder.parents):
        if part.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", part.name):
            return part.name
    return None


def _cached_snapshot(repo_id: str, prefix: str, required: tuple[str, ...], revision: str | None,
                     cache_dir) -> Path | None:
    """The HF-cache folder of `revision` if every required file is there, else None.

    huggingface_hub < 2 cannot resolve a commit hash offline unless a ref points at it, although
    the cache holds snapshots/<commit>/; a pinned revision must load offline on every version.
    """
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        paths = [try_to_load_from_cache(repo_id, prefix + name, cache_dir=cache_dir, revision=revision)
                 for name in required]
    except HFValidationError:  # not a valid repo id: the caller reports the download's own error
        return None
    return Path(paths[0]).parent if paths and all(isinstance(p, str) for p in paths) else None


def upload_files(folder: str | os.PathLike, repo_id: str, names: tuple[str, ...], *, commit_message: str,
                 subfolder: str | None = None, private: bool | None = None, revision: str | None = None,
                 token: str | bool | None = None, create_pr: bool = False):
    """Upload the files `names` of `folder` (those present) to `repo_id`, into `subfolder`, as one commit.

    The repo is created if missing (`private` applies only then); `revision` is a branch, created from
    main if missing; `create_pr=True` opens a pull request against it (or main) instead of committing to
    it. Returns `HfApi.create_commit`'s `CommitInfo` (`.oid`, `.commit_url`, `.pr_revision` ...).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    subfolder = check_subfolder(subfolder)
    prefix = f"{subfolder}/" if subfolder else ""
    api = HfApi(token=token, library_name="hf_varrate", library_version=__version__)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    if revision is not None and revision != "main":
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=prefix + name, path_or_fileobj=str(Path(folder) / name))
                  for name in names if (Path(folder) / name).is_file()]
    return api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision,
                             create_pr=create_pr, repo_type="model")


def is_url(path) -> bool:
    """True for an fsspec URL ('s3://bucket/doc', 'file:///srv/doc', 'memory://doc'): never a Hub repo id."""
    return isinstance(path, str) and "://" in path


@contextmanager
def fetched(url: str, names: tuple[str, ...], *, error: type[Exception], hint: str) -> Iterator[Path]:
    """A temporary local folder holding the files `names` copied from the fsspec `url`, removed on exit;
    `error` (with `hint`) when one is missing there."""
    fs, root = _filesystem(url)
    with tempfile.TemporaryDirectory(prefix="hf_varrate-url-") as folder:
        for name in names:
            if fs.isfile(f"{root}/{name}"):
                fs.get_file(f"{root}/{name}", str(Path(folder) / name))
        missing = [name for name in names if not (Path(folder) / name).is_file()]
        if missing:
            raise error(f"{url} holds no {' or '.join(missing)}. {hint}")
        yield Path(folder)


def put_files(folder: str | os.PathLike, url: str, names: tuple[str, ...]) -> None:
    """Copy the files `names` of `folder` to the fsspec `url` in that order (put the JSON that records the
    others' sha256 last: a reader between two copies is refused by the checksum, never misled)."""
    fs, root = _filesystem(url)
    fs.makedirs(root, exist_ok=True)
    for name in names:
        fs.put_file(str(Path(folder) / name), f"{root}/{name}")


def _filesystem(url: str):
    try:
        from fsspec.core import url_to_fs
    except ImportError as err:
        raise ImportError(f"{url!r} is an fsspec URL, which needs fsspec: pip install 'hf_varrate[fsspec]' (and the "
                          f"filesystem's package, e.g. s3fs for s3://)") from err
    fs, root = url_to_fs(url)
    return fs, root.rstrip("/")
