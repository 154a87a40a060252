"""Writing files and folders so that a reader never sees half of one, and fingerprinting them.

A saved cache or bases artifact is a folder of files that only make sense together, so it is replaced
as a whole (`replacing_folder`): the new files are written into a temporary folder beside the target,
flushed to disk, and the folder then takes the target's place in one step (Linux's
``renameat2(RENAME_EXCHANGE)``; elsewhere two renames, with the previous folder renamed back if the
second fails). Until that step the previous save is untouched and loadable; after it, the new one is
complete. Every failure removes the temporary folder; a process killed mid-save leaves one
(``.<name>.saving-<host>-<pid>-<hex>``), removed by the next save into the same place once that process
is gone. The folder gets the usual permissions (0777 less the umask; a replaced folder keeps its
mode) and its files the same less execute, so another account can read what a service saved for it.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import socket
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def replacing_folder(target: str | os.PathLike, owned: Iterable[str], what: str) -> Iterator[Path]:
    """Yield an empty folder to write the new contents of `target` into; when the block ends without an
    error, it replaces `target` in one step (see the module docstring). `owned` names the files a
    previous save may hold: a `target` holding anything else is refused before anything is written
    (`FileExistsError`), since replacing the folder would delete it. `what` names the artifact in errors."""
    target = _real_target(Path(target))
    _check_replaceable(target, set(owned), what)
    _remove_abandoned(target)
    partial = target.with_name(f".{target.name}.saving-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(partial, 0o777)  # the umask applies, as for any folder the user creates
    try:
        if target.is_dir():
            os.chmod(partial, stat.S_IMODE(target.stat().st_mode))
        yield partial
        _flush(partial)
        _swap_into_place(partial, target)
    finally:
        if partial.exists() or partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)


def interrupted_save(target: str | os.PathLike) -> Path | None:
    """A previous save that a killed save on a platform without an atomic exchange left renamed aside
    (`target` itself then missing), or None. Loaders name it in their error."""
    target = Path(target)
    found = sorted(target.parent.glob(f".{target.name}.previous-*")) if target.parent.is_dir() else []
    return found[-1] if found else None


def _real_target(target: Path) -> Path:
    """A symlink to a folder is followed: the folder it points to is replaced, the link stays."""
    return target.resolve() if target.is_symlink() else target.absolute()


def _check_replaceable(target: Path, owned: set[str], what: str) -> None:
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        return
    if not target.is_dir():
        raise NotADirectoryError(f"{target} is a file, not a folder; save the {what} into a folder (nothing was "
                                 f"written)")
    foreign = sorted(p.name for p in target.iterdir() if p.name not in owned and not _leftover(p.name))
    if foreign:
        raise FileExistsError(f"{target} holds files that are not part of a saved {what} ({foreign[:5]}"
                              f"{' ...' if len(foreign) > 5 else ''}); replacing the folder would delete them, so "
                              f"nothing was written: save into a new or empty folder, or one holding only a "
                              f"previous save")


def _leftover(name: str) -> bool:
    """A temporary file an earlier hf_varrate's per-file writes could leave inside the folder."""
    return name.endswith(".tmp") and name.startswith(("tmp", "."))


def _remove_abandoned(target: Path) -> None:
    """Temporary folders of earlier saves into `target` whose process (on this host) is gone."""
    host = socket.gethostname()
    for leftover in target.parent.glob(f".{target.name}.saving-{host}-*"):
        pid = leftover.name.removeprefix(f".{target.name}.saving-{host}-").split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _flush(folder: Path) -> None:
    """Give every file the folder's permissions less execute (some writers, safetensors among them, create
    files 0600 whatever the umask), fsync each and the folder, so the swap never publishes data still in
    the page cache."""
    mode = stat.S_IMODE(folder.stat().st_mode) & 0o666
    for path in (p for p in folder.iterdir() if p.is_file()):
        os.chmod(path, mode)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open a folder (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _swap_into_place(partial: Path, target: Path) -> None:
    """`partial` becomes `target`; the previous `target` (if any) ends up at `partial`, to be removed."""
    if not target.exists():
        os.rename(partial, target)
    elif not _exchange(partial, target):
        aside = target.with_name(partial.name.replace(".saving-", ".previous-", 1))
        os.rename(target, aside)
        try:
            os.rename(partial, target)
        except BaseException:
            os.rename(aside, target)
            raise
        os.rename(aside, partial)
    _fsync_folder(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically where the OS can (Linux >= 3.15 on most local filesystems); False where not."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # this filesystem cannot exchange: the two-rename path
    raise OSError(code, f"could not move the new save into place: {os.strerror(code)}", str(b))


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
