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
number. Under `torch.compile` every caller takes its PyTorch path (see `_loaded`).
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

from ..paths import cache_root

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
ENV_SWITCH = "HF_VARRATE_NATIVE"

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "dequantize_runs": [_P, _P, _P, _P, _I, _I, _P, ctypes.c_int, ctypes.c_int],
    "coded_key_scores": [_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, ctypes.c_int],
    "anchor_keys": [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P],
    "add_anchor_shares": [_P, _P, _I, _I, _I, _P, _I, _P, ctypes.c_int],
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
    """The library, or None: switched off, not buildable, or inside torch.compile's tracing, where tensors
    have no memory for a C loop to read (a ctypes call there could crash the process): the traced graph
    then holds the PyTorch path, which computes the same."""
    return None if _off or _tracing() else _library()


def _tracing() -> bool:
    return torch.compiler.is_compiling()


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


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def _in_range(index: torch.Tensor, size: int) -> bool:
    return index.numel() == 0 or (0 <= int(index.min()) and int(index.max()) < size)


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
    if not (_in_range(neighbours, anchors.shape[0]) and _in_range(positions, turns.shape[0])):
        return None
    proj, anchors, neighbours = proj.contiguous(), anchors.float().contiguous(), neighbours.long().contiguous()
    turns, positions, queries = turns.float().contiguous(), positions.long().contiguous(), queries.float().contiguous()
    scores = torch.empty(heads, rows, n_tokens)
    library.coded_key_scores(_ptr(proj), int(proj.dtype == torch.bfloat16), n_tokens, heads, dim, _ptr(anchors),
                             _ptr(neighbours), neighbours.shape[1], _ptr(turns), _ptr(positions), _ptr(queries), rows,
                             _ptr(scores), torch.get_num_threads())
    return scores


def anchor_keys(exact_keys: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, turns: torch.Tensor,
                n_neighbours: int) -> torch.Tensor | None:
    """`attend._anchor_keys` in one pass: exact_keys [H, E, d] (post-RoPE), rows [A] (the anchors among them),
    positions [A], turns [S, d/2, 2] -> [A, H * d] fp32, un-rotated, / n_neighbours, pairs adjacent. None where
    it does not apply."""
    library = _loaded()
    if library is None or exact_keys.device.type != "cpu":
        return None
    heads, n_exact, dim = exact_keys.shape
    if not (_in_range(rows, n_exact) and _in_range(positions, turns.shape[0])):
        return None
    keys, rows, positions = exact_keys.float().contiguous(), rows.long().contiguous(), positions.long().contiguous()
    turns = turns.float().contiguous()
    out = torch.empty(rows.numel(), heads * dim)
    library.anchor_keys(_ptr(keys), heads, n_exact, dim, _ptr(rows), _ptr(positions), rows.numel(), _ptr(turns),
                        n_neighbours, _ptr(out))
    return out


def add_anchor_shares(coded: torch.Tensor, exact: torch.Tensor, neighbours: torch.Tensor, anchor_rows: torch.Tensor) -> bool:
    """exact[..., anchor_rows[neighbours[t, n]]] += coded[..., t] / n_neighbours for every t and n, in place:
    coded [..., C] and exact [..., E] are fp32 views into one [..., N] buffer whose last dim is contiguous.
    False where it does not apply (the caller adds them with index_add_)."""
    library = _loaded()
    if (library is None or coded.device.type != "cpu" or coded.dtype != torch.float32 or exact.dtype != torch.float32
            or coded.stride(-1) != 1 or exact.stride(-1) != 1 or coded.stride()[:-1] != exact.stride()[:-1]):
        return False
    flat = coded.shape[:-1].numel()
    row_stride = coded.stride(-2) if coded.dim() > 1 else coded.shape[-1]
    if coded.dim() > 2 and any(coded.stride(i) != coded.stride(i + 1) * coded.shape[i + 1] for i in range(coded.dim() - 2)):
        return False  # the leading dims must flatten to rows of one stride
    if not (_in_range(neighbours, anchor_rows.numel()) and _in_range(anchor_rows, exact.shape[-1])):
        return False
    neighbours, anchor_rows = neighbours.long().contiguous(), anchor_rows.long().contiguous()
    library.add_anchor_shares(_ptr(coded), _ptr(exact), flat, row_stride, coded.shape[-1], _ptr(neighbours),
                              neighbours.shape[1], _ptr(anchor_rows), torch.get_num_threads())
    return True
