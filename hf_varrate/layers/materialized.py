"""`MaterializedLayer`: the coded prompt reconstructed once at the prefill and held at full length.

What the paper does: `keys` / `values` hold full-length K/V like a DynamicLayer (the prompt's coded
tokens replaced by their reconstruction), `codes` the codes (for `footprint()` and saving). Fastest
decoding; memory is that of a DynamicCache plus the codes.
"""

from __future__ import annotations

import torch

from ..codec import compress_prompt, tensor_bytes
from ..errors import CacheFileError
from .base import VarRateLayer
from .footprint import LayerFootprint
from .rows import place, slots_of
from .turns import Turn, exact_pieces


class MaterializedLayer(VarRateLayer):
    storage = "materialized"

    def _store(self, rows, coding, scaling, keys, values, share) -> None:
        self.keys, self.values = keys, values
        whole = len(rows) == 1 and rows[0].span == (0, keys.shape[-2])
        for b, row in enumerate(rows):
            code, k_hat, v_hat = compress_prompt(row.keys, row.values, row.queries, row.cos, row.sin, coding[0],
                                                 self.config, scaling, scales=coding[1], layer_share=share)
            self.codes.append(code)
            self.spans.append(row.span)
            if k_hat is None:
                continue
            if whole:
                self.keys, self.values = k_hat, v_hat
                continue
            if self.keys is keys:
                self.keys, self.values = keys.clone(), values.clone()
            place(self.keys[b : b + 1], row.span, k_hat)
            place(self.values[b : b + 1], row.span, v_hat)

    def _adopt(self, layer) -> None:
        """From a compact layer: rebuild the prompt once; the codes no longer hold their exact tokens."""
        self.keys, self.values = layer.read()
        for code in self.codes + [code for turn in self.turns for code in turn.codes]:
            code.exact_keys = code.exact_values = None

    def exact_tokens(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's exact tokens [1, H, E, d], gathered from the full-length tensors."""
        code = self.codes[b]
        if self.prompt_kept < self.prompt_len:
            raise ValueError(f"layer {self.layer_idx} was cropped into its compressed prompt in materialized storage, "
                             f"which dropped exact tokens its codes need")
        slots = slots_of(self.spans[b], self.keys.device)[code.exact_pos]
        return self.keys[b : b + 1, :, slots], self.values[b : b + 1, :, slots]

    def appended_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens after the prompt stored exactly (coded later turns left out)."""
        if not self.turns:
            return self.keys[..., self.prompt_kept :, :], self.values[..., self.prompt_kept :, :]
        pieces = exact_pieces(self.turns, self.prompt_kept, self.keys.shape[-2])
        return (torch.cat([self.keys[..., a:b, :] for a, b in pieces] or [self.keys[..., :0, :]], dim=-2),
                torch.cat([self.values[..., a:b, :] for a, b in pieces] or [self.values[..., :0, :]], dim=-2))

    def turn_exact_tokens(self, turn: Turn, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's exact tokens of a coded later turn, gathered from the full-length tensors."""
        if turn.kept < turn.length:
            raise ValueError(f"layer {self.layer_idx} was cropped into a coded later turn in materialized storage, "
                             f"which dropped exact tokens its code needs")
        slots = turn.start + turn.codes[b].exact_pos.to(self.keys.device)
        return self.keys[b : b + 1, :, slots], self.values[b : b + 1, :, slots]

    def _turn_tokens(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, start : start + length], self.values[:, :, start : start + length]

    def _store_turn(self, row, coding, scaling, share, start):
        code, k_hat, v_hat = compress_prompt(row.keys, row.values, row.queries, row.cos, row.sin, coding[0],
                                             self.config, scaling, scales=coding[1], layer_share=share)
        if k_hat is not None:  # in place: the turn's slots now hold what its code gives back
            self.keys[:, :, start : start + k_hat.shape[-2]] = k_hat
            self.values[:, :, start : start + v_hat.shape[-2]] = v_hat
        return code

    def to_tensors(self, prefix: str):
        if any(turn.kept < turn.length for turn in self.turns):
            raise CacheFileError(f"layer {self.layer_idx} was cropped into a coded later turn in materialized "
                                 f"storage, which drops exact tokens its code needs; save before cropping, or use "
                                 f"storage='compact'")
        if self.prompt_kept < self.prompt_len:
            raise CacheFileError(f"layer {self.layer_idx} was cropped into its compressed prompt in materialized "
                                 f"storage, which drops exact tokens its codes need; save before cropping, or use "
                                 f"storage='compact'")
        return super().to_tensors(prefix)

    def footprint(self) -> LayerFootprint:
        if not self.codes:  # never compressed: held exactly, like a DynamicLayer
            held = tensor_bytes(self.keys, self.values) if self.is_initialized else 0
            return LayerFootprint(self.layer_idx, "exact", held, held)
        full, tail, kept = self._full_bytes()
        stored = sum(code.nbytes(limit=n) for code, n in zip(self.codes, kept)) + self._turn_bytes()
        codes = self.codes + [code for turn in self.turns for code in turn.codes]
        held = tensor_bytes(self.keys, self.values) + sum(tensor_bytes(*code.held_tensors()) for code in codes)
        return LayerFootprint(self.layer_idx, "varrate", stored + tail, full, self.rows_stored_exactly, tail, held)
