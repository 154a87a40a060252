"""Building and loading `native.c`, the C loops of a prompt's coding and a compact layer's read, on first use.

The shared library is compiled with ``$CC`` (else ``cc``) for this CPU (``-march=native``) with OpenMP
where the compiler has it, into ``$HF_VARRATE_CACHE/kernels`` (see `hf_varrate.models`), keyed by the
source, the compiler and the CPU, and loaded with ctypes; it takes about a second, once per machine.
Where it cannot be built (no compiler, or ``HF_VARRATE_NATIVE=0``) `library()` is None and the first
failure says why once (a `RuntimeWarning`). `ops` wraps the loops as torch custom ops; `native` decides
when a read uses them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

from ..paths import cache_root

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
ENV_SWITCH = "HF_VARRATE_NATIVE"

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "dequantize_runs": [_P, ctypes.c_int, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int, ctypes.c_int],
    "coded_key_scores": [_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, ctypes.c_int],
    "anchor_keys": [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P],
    "add_anchor_shares": [_P, _P, _I, _I, _I, _P, _I, _P, ctypes.c_int],
    "joint_rows": [_P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, ctypes.c_int],
    "smallest_columns": [_P, _I, _I, _I, _P, _P, ctypes.c_int],
    "subtract_means": [_P, _I, _I, _P, _P, _I, _P, ctypes.c_int],
    "group_ranges": [_P, ctypes.c_int, _I, _P, _I, _I, _P, _P, ctypes.c_int],
    "quantize_runs": [_P, ctypes.c_int, _I, _P, _I, _I, ctypes.c_int, _P, _P, _P, _I, _P, ctypes.c_int],
    "component_ranges": [_P, ctypes.c_int, _I, _P, _I, _I, _I, _I, _P, _P, ctypes.c_int],
    "quantize_component_runs": [_P, ctypes.c_int, _I, _P, _I, _I, _I, ctypes.c_int, _P, _P, _P, _I, _P, ctypes.c_int],
}


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it is switched off or cannot be built (said once, as a warning).
    `library.cache_clear()` forgets it (tests that change how it is found)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        loaded = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        warnings.warn(f"hf_varrate's C loops for compact reads are not available ({error}); compact reads use "
                      f"PyTorch (correct, slower). Set {ENV_SWITCH}=0 to skip the attempt", RuntimeWarning,
                      stacklevel=4)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(loaded, name).argtypes = argtypes
        getattr(loaded, name).restype = None
    return loaded


def build() -> Path:
    """The shared library for this source, compiler and CPU, compiled into the cache if not there yet."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]  # CC may hold flags
    if compiler[0] is None:
        raise RuntimeError("no C compiler found (set CC, or install one, e.g. apt install gcc)")
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), _cpu().encode()]))
    target = cache_root() / "kernels" / f"native-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        # without OpenMP the loops run on one thread; without -march=native they are generic
        for arch in (["-march=native", "-fopenmp"], ["-march=native"], []):
            done = subprocess.run([*compiler, *FLAGS, *arch, str(SOURCE), "-o", str(built)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{' '.join(compiler)} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: processes building at once each load a whole file
    return target


def _cpu() -> str:
    """What -march=native depends on: the machine, and its CPU's flags where Linux lists them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}"
