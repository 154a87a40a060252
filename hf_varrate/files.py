"""Writing files so that a reader never sees half of one, and fingerprinting them."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside `path` and rename into place, so a reader never sees half a file (mode per umask)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
