"""`CodingSpaces`: the tensors a model's bases are coded and read with, derived once and kept.

Per layer, device and coding space, one copy of the basis the layer codes with, in the stored tensor's dtype (fp16
for shipped bases; the matmuls convert it, blocks at a time, to the dtype they compute in): balance='rms' and
key_weight scale the value half (`codec.balance`, derived in fp64 and rounded once); unscaled, the stored basis
itself. With it, its half scales (per-layer budgets take the scaled space's singular values alone). Attention over
the codes reads that copy with each head's key dims in RoPE-pair order (`codec.attend.paired_columns`): at the
first read the copy is reordered in place of the one kept, and coding derives the natural order from it when it
needs it (a permutation: the same numbers). Once a layer's copy exists, bases read from a file let the stored
tensor go (`stored.StoredTensors.release`; read again from the file when needed). The copy is held in 8 bits under
the default `basis_bits=8` (`codec.basis_bits`; read back to the stored dtype, one layer at a time, when coding or
attention needs it). So a model's bases cost one 8-bit copy per layer and device, not the stored tensors plus fp32
copies. Reached through a `Bases` (`bases.spaces`) and shared by every `Bases` of the same content (two caches
loading the same folder make one set of copies per device, held while any of them lives), and `nbytes` counts them.
"""

from __future__ import annotations

import hashlib
import math
import warnings
import weakref
from typing import NamedTuple

import torch

from .codec import tensor_bytes
from .codec.attend import paired_columns
from .codec.balance import balanced_basis, balanced_spectrum
from .codec.basis_bits import Int8Basis, basis_tensors, held_basis, readable
from .codec.layer_budget import energy_shares, recorded_scales
from .codec.budget import counted_dtype
from .errors import BasesError, VarRateWarning
from .stored import tensor_digest


class CodingCopy(NamedTuple):
    """One layer's coding basis [R, D] on one device (in the stored dtype, or in 8 bits: `codec.basis_bits`), its
    half scales [D] (None: unscaled) and the head dim its key columns are paired for (None: in the stored order)."""

    basis: torch.Tensor | Int8Basis
    scales: torch.Tensor | None
    paired_dim: int | None


class DerivedCopies:
    """The derived tensors themselves, shared by the `CodingSpaces` of equal bases (`shared_copies`)."""

    def __init__(self):
        self.coding: dict[tuple, CodingCopy] = {}  # (layer, device, balance, key_weight, bits) -> the one copy
        self.energies: dict[tuple, tuple[torch.Tensor, dict[int, int]]] = {}  # (balance, key_weight) -> shares


# content digest -> the copies of bases with that content, while some Bases holds them (weak: no leak)
_SHARED: weakref.WeakValueDictionary[str, DerivedCopies] = weakref.WeakValueDictionary()


def shared_copies(bases) -> DerivedCopies:
    """The copies for bases of this content (their stored tensors' digests, taken once by `StoredTensors`, and
    their spectra, hashed): made once, shared."""
    digest = hashlib.sha256()
    for i in sorted(bases.tensors):
        digest.update(f"basis{i}{bases.tensors.digest(i)}".encode())
    for i in sorted(bases.spectra):
        digest.update(f"spectrum{i}{tensor_digest(bases.spectra[i])}".encode())
    key = digest.hexdigest()
    copies = _SHARED.get(key)
    if copies is None:
        copies = _SHARED[key] = DerivedCopies()
    return copies


class CodingSpaces:
    """The derived tensors of one `Bases` (read through it: its tensors and spectra never change), kept in
    `DerivedCopies` shared with every other `Bases` of the same content (found on first use)."""

    def __init__(self, bases):
        self.bases = bases
        self._copies: DerivedCopies | None = None
        self._measured: dict[float, dict[int, float]] = {}  # budget (as measured) -> per-layer scales; not shared

    @property
    def copies(self) -> DerivedCopies:
        if self._copies is None:
            self._copies = shared_copies(self.bases)
        return self._copies

    def basis(self, layer_idx: int, device=None) -> torch.Tensor:
        """[R, D] on `device` in the stored dtype and order (the stored tensor itself while it is on `device` and no
        read has reordered the kept copy)."""
        return self.coding_basis(layer_idx, "none", device, bits=None)[0]

    def _upload(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        if layer_idx not in self.bases.tensors:
            raise BasesError(f"bases have no tensor for layer {layer_idx}; they cover {sorted(self.bases.tensors)}")
        return self.bases.tensors[layer_idx].to(device=device).contiguous()

    def attention_basis(self, layer_idx: int, balance: str, device, heads: int, dim: int, key_weight: float = 1.0,
                        bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The coding basis as attention over the codes reads it (`codec.attend.attend_codes`'s `split`): views of
        the one copy kept per layer, coding space and device (of an 8-bit copy read back), reordered for reading
        at the first call."""
        key, copy = self._coding_copy(layer_idx, balance, device, key_weight, bits)
        if copy.paired_dim is None:
            order = paired_columns(copy.basis.shape[1], dim, copy.basis.device)
            copy = self.copies.coding[key] = CodingCopy(copy.basis.index_select(1, order), copy.scales, dim)
        elif copy.paired_dim != dim:
            raise ValueError(f"layer {layer_idx} was read with head dim {copy.paired_dim} and now {dim}")
        half, basis = heads * dim, readable(copy.basis)
        scales = None if copy.scales is None else copy.scales[half:]
        return basis[:, :half], basis[:, half:], scales

    def layer_copies(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """{name: tensor} of every copy derived for layer `layer_idx` (on each device it was asked for): what a
        model split across devices must find on that layer's device (`hf_varrate.devices`)."""
        return {f"coding {key} {i}": t for key, copy in self.copies.coding.items() if key[0] == layer_idx
                for i, t in enumerate(self._copy_tensors(copy))}

    def nbytes(self) -> int:
        """Bytes of every tensor these bases hold: the stored ones and the copies made for coding and reading
        (per device and coding space). Shared by every cache built on them: a per-model cost."""
        held = [*self.bases.tensors.resident(), *self.bases.spectra.values(),
                *(t for copy in self.copies.coding.values() for t in self._copy_tensors(copy))]
        return tensor_bytes(*{id(t): t for t in held}.values())  # identity bases share one tensor

    def coding_basis(self, layer_idx: int, balance: str, device=None, key_weight: float = 1.0,
                     bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The basis [R, D] a layer codes with (stored dtype) and its half scales [D] fp32 (None: unscaled, the
        paper's z_t); balance='rms' or a key_weight other than 1 derives them once per layer and device
        (`codec.balance.balanced_basis`), and `bits=8` holds the copy in 8 bits (`codec.basis_bits`; then a
        read-back copy). In the stored column order: once attention has read the layer, a reordered copy of the
        one kept (not kept itself)."""
        _, copy = self._coding_copy(layer_idx, balance, device, key_weight, bits)
        basis = readable(copy.basis)
        if copy.paired_dim is None:
            return basis, copy.scales
        order = paired_columns(basis.shape[1], copy.paired_dim, basis.device)
        return basis.index_select(1, order.argsort()), copy.scales

    @staticmethod
    def _copy_tensors(copy: CodingCopy) -> list[torch.Tensor]:
        return [*basis_tensors(copy.basis), *([] if copy.scales is None else [copy.scales])]

    def _coding_copy(self, layer_idx: int, balance: str, device, key_weight: float,
                     bits: int | None = None) -> tuple[tuple, CodingCopy]:
        """(key, the one copy kept for this layer, device, coding space and precision), derived at the first
        call."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        key = (layer_idx, str(device), balance, float(key_weight), bits)
        if key not in self.copies.coding:
            basis = self._upload(layer_idx, device)
            if balance == "none" and key_weight == 1.0:
                copy = CodingCopy(basis, None, None)  # the stored tensor itself where it is
            else:
                copy = self._balanced_copy(key, basis)
            self.copies.coding[key] = copy._replace(basis=held_basis(copy.basis, bits))
        self.bases.tensors.release(layer_idx)  # the copy codes from now on (even one another Bases made)
        return key, self.copies.coding[key]

    def _balanced_copy(self, key: tuple, basis: torch.Tensor) -> CodingCopy:
        """The scaled space's basis (`codec.balance.balanced_basis`, in fp64) rounded to `basis`'s dtype."""
        layer_idx, _, balance, key_weight, _ = key
        spectrum = self.bases.spectrum(layer_idx)
        if spectrum is None:
            raise ValueError(
                f"balance={balance!r} needs bases that carry their calibration spectrum (tensors spectrum.<i>), "
                f"and these have none for layer {layer_idx}; recalibrate them with this version of hf_varrate "
                f"(hf-varrate calibrate ...) or use balance='none'"
            )
        balanced, scales, _ = balanced_basis(basis.float(), spectrum, balance, key_weight)
        return CodingCopy(balanced.to(basis.dtype), scales, None)

    def coding_energies(self, balance: str, key_weight: float = 1.0) -> tuple[torch.Tensor, dict[int, int]]:
        """(energies [L, R] of every compressed layer's coding space, {layer index: row}) for per-layer
        budgets (`codec.layer_budget`): the shipped spectra, or the scaled space's (`codec.balance.balanced_spectrum`,
        derived on the CPU from the stored tensors: no layer's coding copy is made here, on any device)."""
        if (balance, key_weight) not in self.copies.energies:
            layers = sorted(self.bases.tensors)
            missing = [i for i in layers if self.bases.spectrum(i) is None]
            if missing:
                raise ValueError(
                    f"layer_budgets='spectrum' needs bases that carry their calibration spectrum (tensors "
                    f"spectrum.<i>), and these have none for layers {missing[:5]}; recalibrate them with this "
                    f"version of hf_varrate (hf-varrate calibrate ...) or use layer_budgets='uniform'"
                )
            if balance == "none" and key_weight == 1.0:
                spectra = [self.bases.spectrum(i) for i in layers]
            else:
                spectra = [balanced_spectrum(self.bases.tensors[i], self.bases.spectrum(i), balance, key_weight)
                           for i in layers]  # in fp64 there: no fp32 copy first
            self.copies.energies[(balance, key_weight)] = (energy_shares(spectra),
                                                           {i: row for row, i in enumerate(layers)})
        return self.copies.energies[(balance, key_weight)]

    def layer_share(self, layer_idx: int, config, kv_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, int] | float | None:
        """What `compress_prompt(layer_share=...)` takes for layer `layer_idx` under `config.layer_budgets`
        ('spectrum': the coding spaces' energies and this layer's row; 'measured': this layer's scale, measured at
        the bytes `config.budget` buys when counted in `config.budget_dtype`, else in `kv_dtype`, the K/V's own;
        'uniform': None)."""
        if config.layer_budgets == "uniform":
            return None
        if config.layer_budgets == "measured":
            return self.measured_scales(config.budget, counted_dtype(config, kv_dtype))[layer_idx]
        energies, rows = self.coding_energies(config.balance, config.key_weight)
        return energies, rows[layer_idx]

    def measured_scales(self, budget: float, counted: torch.dtype | None = None) -> dict[int, float]:
        """{layer: scale} from the bases' measured sensitivity (`codec.layer_budget.recorded_scales`) at the measured
        budget nearest `budget` (in ratio), where a budget counted in `counted` (None: as measured) is first put in
        the dtype the measurement counted in: 0.1 of fp32 K/V buys the coefficients of 0.2 counted in fp16. A
        VarRateWarning, once, when the nearest is more than 1.5x away."""
        measured = self.bases.metadata.get("layer_sensitivity")
        if not measured:
            raise ValueError(
                "layer_budgets='measured' needs bases that carry a per-layer sensitivity measurement (config.json "
                "field layer_sensitivity), and these carry none; add one with `hf-varrate measure-layers "
                "<bases folder> --model <model>` or use layer_budgets='uniform'")
        unit = (measured.get("settings") or {}).get("budget_dtype")
        same = counted is None or unit is None
        equivalent = budget if same else budget * counted.itemsize / getattr(torch, unit).itemsize
        if equivalent not in self._measured:
            nearest = min(measured["kl"], key=lambda b: abs(math.log(float(b) / equivalent)))
            if abs(math.log(float(nearest) / equivalent)) > math.log(1.5):
                asked = f"budget={budget}" + ("" if same or equivalent == budget else
                                              f" counted in {counted} ({equivalent:g} in {unit})")
                warnings.warn(f"layer_budgets='measured': these bases were measured at budgets {sorted(measured['kl'])}"
                              f"; {asked} uses the scales of {nearest}. Measure at {equivalent:g} for better ones "
                              f"(hf-varrate measure-layers ... --budgets {equivalent:g})", VarRateWarning, stacklevel=4)
            self._measured[equivalent] = recorded_scales(measured)[nearest]
        return self._measured[equivalent]
