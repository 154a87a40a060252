"""Optional C loops for a compact layer's read, built on first use with the system's C compiler.

Attending over the codes (`attend.attend_codes`) spends most of a read on elementwise passes over
layer-sized buffers: unpacking and scaling 4-bit codes, adding the anchor means, RoPE, the scores.
`native.c` does each in one pass; nothing else changes (same arithmetic, same results: bit for bit
for the dequantization, to float rounding for the scores). Where the library cannot be built (no
compiler, or `HF_VARRATE_NATIVE=0`) every caller keeps its PyTorch path, and the first failure says why
once (a `RuntimeWarning`).

The shared library is compiled with ``$CC`` (else ``cc``) for this CPU (``-march=native``) with OpenMP
where the compiler has it, into ``$HF_VARRATE_CACHE/kernels`` (see `hf_varrate.models`), keyed by the
source, the compiler and the CPU, and loaded with ctypes; it takes about a second, once per machine.
The loops run on `torch.get_num_threads()` threads (one without OpenMP), with the same results on any
number.
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
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
ENV_SWITCH = "HF_VARRATE_NATIVE"

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "dequantize_runs": [_P, _P, _P, _P, _I, _I, _P, ctypes.c_int, ctypes.c_int],
    "coded_key_scores": [_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, ctypes.c_int],
}


_off = False  # set by `disabled()`


def available() -> bool:
    """Whether the C loops are in use (built and loaded here, and not switched off)."""
    return _loaded() is not None


@contextmanager
def disabled():
    """Within this block every caller takes its PyTorch path (to compare the two, or to rule the C loops out)."""
    global _off
    previous, _off = _off, True
    try:
        yield
    finally:
        _off = previous


def _loaded() -> ctypes.CDLL | None:
    return None if _off else _library()


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        warnings.warn(f"hf_varrate's C loops for compact reads are not available ({error}); compact reads use "
                      f"PyTorch (correct, slower). Set {ENV_SWITCH}=0 to skip the attempt", RuntimeWarning,
                      stacklevel=3)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = None
    return library


def _build() -> Path:
    """The shared library for this source, compiler and CPU, compiled into the cache if not there yet."""
    from ..models import _cache_root

    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]  # CC may hold flags
    if compiler[0] is None:
        raise RuntimeError("no C compiler found (set CC, or install one, e.g. apt install gcc)")
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), _cpu().encode()]))
    target = _cache_root() / "kernels" / f"native-{key.hexdigest()[:16]}.so"
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


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def dequantize_runs(coefs, runs: list[tuple[int, int, int]], dtype: torch.dtype) -> torch.Tensor | None:
    """`quantization.dequantize_runs(coefs, layout).to(dtype)` in one pass, for 4-bit codes on CPU and dtype
    float32 or bfloat16; None where it does not apply (the caller dequantizes in PyTorch)."""
    library = _loaded()
    codes = coefs.codes
    if library is None or coefs.bits != 4 or codes.device.type != "cpu" or dtype not in (torch.float32,
                                                                                         torch.bfloat16):
        return None
    values = sum((stop - first) * rank for first, stop, rank in runs)
    groups = sum((stop - first) * -(-rank // coefs.group) for first, stop, rank in runs)
    if values != coefs.count or values > 2 * codes.numel() or groups > min(coefs.steps.numel(), coefs.mins.numel()):
        return None  # not this stream's runs: PyTorch's path raises
    out = torch.empty(coefs.count, dtype=dtype)
    steps, mins = coefs.steps.float().contiguous(), coefs.mins.float().contiguous()
    table = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3)
    codes = codes.contiguous()
    library.dequantize_runs(_ptr(codes), _ptr(steps), _ptr(mins), _ptr(table), len(runs), coefs.group, _ptr(out),
                            int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def coded_key_scores(proj: torch.Tensor, anchors: torch.Tensor, neighbours: torch.Tensor, turns: torch.Tensor,
                     positions: torch.Tensor, queries: torch.Tensor) -> torch.Tensor | None:
    """The coded tokens' unscaled scores [H, rows, C]: queries [H, rows, d] (paired dims) against the keys
    `anchors[neighbours].sum(1) + proj`, rotated by `turns[positions]` (see `attend._coded_keys`). proj
    [C, H * d] fp32 or bf16, anchors [A, H * d] fp32, neighbours [C, n] int64, turns [S, d/2, 2] fp32,
    positions [C] int64. None where it does not apply, or where an index is out of range (PyTorch's path then
    raises the IndexError; the C loop does not check)."""
    library = _loaded()
    if library is None or proj.device.type != "cpu" or proj.dtype not in (torch.float32, torch.bfloat16):
        return None
    heads, rows, dim = queries.shape
    n_tokens = proj.shape[0]
    if n_tokens and not (0 <= int(neighbours.min()) and int(neighbours.max()) < anchors.shape[0]
                         and 0 <= int(positions.min()) and int(positions.max()) < turns.shape[0]):
        return None
    proj, anchors, neighbours = proj.contiguous(), anchors.float().contiguous(), neighbours.long().contiguous()
    turns, positions, queries = turns.float().contiguous(), positions.long().contiguous(), queries.float().contiguous()
    scores = torch.empty(heads, rows, n_tokens)
    library.coded_key_scores(_ptr(proj), int(proj.dtype == torch.bfloat16), n_tokens, heads, dim, _ptr(anchors),
                             _ptr(neighbours), neighbours.shape[1], _ptr(turns), _ptr(positions), _ptr(queries), rows,
                             _ptr(scores), torch.get_num_threads())
    return scores
