"""A coding basis held in 8 bits: the copy each layer codes and reads with, at half a 16-bit basis's bytes.

Each row (basis vector) of a basis [R, D] is stored as int8 in two halves, its key columns and its value
columns, each with its own scale: the half's largest magnitude (fp32), so a row's entry x is held as
round(127 x / peak) and read back as q * peak / 127 (exact for a row of 0s and +-1s, an identity basis's).
Per-half scales keep a balanced basis's value half (scaled against its keys) as precise as its key half, and
let attention reorder a half's columns without requantizing. The relative error per row is about 1% of the
row's norm (measured on the shipped bases: `tests/test_basis_bits.py`), below the 4-bit coefficients' error it
is added to; the codes are computed and read with the same rounded basis.

A read (`Int8Basis.read`) makes a transient basis in the stored dtype: one layer's, for one coding or one
attention step, then freed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LEVELS = 127  # int8 codes in [-127, 127]


class Int8Basis(NamedTuple):
    """A basis [R, D] as int8 `codes`, the largest magnitude of each row's key and value half (`peaks` [R, 2]
    fp32) and the dtype it reads back as."""

    codes: torch.Tensor
    peaks: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def read(self) -> torch.Tensor:
        """The basis [R, D] in `dtype` (a new tensor)."""
        rows, width = self.codes.shape
        halves = self.codes.view(rows, 2, width // 2).float() * self.peaks[:, :, None]
        return halves.div_(LEVELS).view(rows, width).to(self.dtype)

    def index_select(self, dim: int, order: torch.Tensor) -> Int8Basis:
        """The basis with its columns in `order`, which must keep every column in its half."""
        half = self.codes.shape[1] // 2
        if dim != 1 or bool((order[:half] >= half).any()) or bool((order[half:] < half).any()):
            raise ValueError("an 8-bit basis can only reorder its columns within the key half and the value half")
        return Int8Basis(self.codes.index_select(1, order), self.peaks, self.dtype)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.peaks


def quantize_basis(basis: torch.Tensor) -> Int8Basis:
    """`basis` [R, D] (D even: key columns, then value columns) held in 8 bits."""
    rows, width = basis.shape
    if width % 2:
        raise ValueError(f"a basis of odd width {width} has no key and value halves to quantize")
    halves = basis.float().view(rows, 2, width // 2)
    peaks = halves.abs().amax(dim=-1)  # [R, 2]
    scaled = halves * (LEVELS / peaks.clamp_min(torch.finfo(torch.float32).tiny))[:, :, None]
    codes = scaled.round_().clamp_(-LEVELS, LEVELS).to(torch.int8).view(rows, width)
    return Int8Basis(codes, peaks, basis.dtype)


def readable(basis: torch.Tensor | Int8Basis) -> torch.Tensor:
    """The basis as a tensor: `basis` itself, or an 8-bit one read back."""
    return basis.read() if isinstance(basis, Int8Basis) else basis


def basis_tensors(basis: torch.Tensor | Int8Basis) -> tuple[torch.Tensor, ...]:
    """The tensors `basis` holds (for counting bytes and checking devices)."""
    return basis.tensors() if isinstance(basis, Int8Basis) else (basis,)


def held_basis(basis: torch.Tensor, bits: int | None) -> torch.Tensor | Int8Basis:
    """`basis` as a layer's coding copy holds it under `basis_bits=bits` (8, or None: as it is)."""
    return quantize_basis(basis) if bits == 8 else basis
