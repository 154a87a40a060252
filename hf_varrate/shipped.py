"""The bases that ship inside the package, found by name.

    VarRateCache.from_pretrained("smollm2-135m-instruct")

A shipped name is resolved before a local folder or a Hub repo id, so it works from any directory
and offline. The files are package data under `hf_varrate/shipped_bases/<name>/`; bases you build
(`hf-varrate calibrate --out my-bases`) or pull (`your-name/some-bases`) are named by their folder
or repo id as before.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SHIPPED", "SHIPPED_ROOT", "shipped_path"]

SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped_bases"

# name -> the Hub checkpoint the bases were calibrated on (the names are those of `hf_varrate.models`)
SHIPPED: dict[str, str] = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma-3-270m": "google/gemma-3-270m",
}


def shipped_path(name: str | os.PathLike) -> Path | None:
    """The folder of the shipped bases called `name`, or None when `name` is not a shipped name."""
    key = str(name)
    return SHIPPED_ROOT / key if key in SHIPPED else None
