"""`StoredTensors`: a bases artifact's per-layer tensors, held in memory or read again from their verified file.

Coding and reading use the copies `hf_varrate.spaces` derives from these tensors (one per layer, device and
coding space). Once a layer's copy exists, the stored tensor it came from is needed again only by rarer
callers (another coding space, a save, a check), so bases read from a file let it go (`release`) and read it
back when asked, checked against the sha256 of its bytes taken when the file was read and verified. Bases
built in memory (calibration, `Bases.from_tensors`) have no file to read from and hold every tensor.
`resident()` is what is really held: what `Bases.nbytes` counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

from .errors import BasesError


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    tensor = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


class StoredTensors(Mapping):
    """{layer index: basis [R, D]} as stored. With `file` (the verified `bases.safetensors` they were read
    from, tensors `layers.<i>`), a layer can be released from memory and is read again on access."""

    def __init__(self, tensors: Mapping, file: str | Path | None = None):
        self._held = {int(i): t for i, t in tensors.items()}
        self._layers = sorted(self._held)
        self.file = Path(file) if file is not None else None
        # taken now where a layer may be released (its file then re-checked against it), else when first asked
        self._digests = {i: tensor_digest(t) for i, t in self._held.items()} if self.file is not None else {}

    def digest(self, layer_idx: int) -> str:
        """`tensor_digest` of layer `layer_idx`'s stored tensor, taken once (never re-reading a released one)."""
        if layer_idx not in self._digests:
            self._digests[layer_idx] = tensor_digest(self._held[layer_idx])
        return self._digests[layer_idx]

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        held = self._held.get(layer_idx)
        if held is not None:
            return held
        if self.file is None or layer_idx not in self._digests:
            raise KeyError(layer_idx)
        return self._read(layer_idx)

    def __contains__(self, layer_idx) -> bool:
        return layer_idx in self._layers

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def release(self, layer_idx: int) -> None:
        """Let layer `layer_idx`'s tensor go from memory, if it can be read again from the file (else keep it)."""
        if self.file is not None:
            self._held.pop(layer_idx, None)

    def resident(self) -> list[torch.Tensor]:
        """The tensors held in memory now."""
        return list(self._held.values())

    def _read(self, layer_idx: int) -> torch.Tensor:
        from safetensors import safe_open

        reload = ("load the bases again (Bases.from_pretrained / VarRateCache.from_pretrained), which reads and "
                  "verifies the folder")
        try:
            with safe_open(str(self.file), framework="pt") as handle:
                tensor = handle.get_tensor(f"layers.{layer_idx}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a missing file, or safetensors' Rust panics (BaseException)
            raise BasesError(f"layer {layer_idx}'s basis is read again from {self.file} when needed, and that "
                             f"failed ({type(exc).__name__}: {exc}): the file was moved or removed after the bases "
                             f"were loaded; {reload}") from exc
        if tensor_digest(tensor) != self._digests[layer_idx]:
            raise BasesError(f"layer {layer_idx}'s basis in {self.file} changed after the bases were loaded (its "
                             f"bytes differ from those verified then); {reload}")
        return tensor
