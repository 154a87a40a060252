"""Where hf_varrate keeps what it builds on this machine (converted models, compiled C loops)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$HF_VARRATE_CACHE`, else `$XDG_CACHE_HOME/hf_varrate`, else `~/.cache/hf_varrate`."""
    if os.environ.get("HF_VARRATE_CACHE"):
        return Path(os.environ["HF_VARRATE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "hf_varrate"
