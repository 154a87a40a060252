"""`CompactLayer`: only the codes and the exact tokens are held; the prompt is rebuilt when read.

`codes[b].exact_keys` / `exact_values` hold row b's exact tokens; `keys` / `values` hold only the
tokens appended after the prefill. Every read rebuilds the prompt (`read`), except under the
"varrate" attention implementation (`hf_varrate.attention`), which attends over the codes (`attend`).
Re-rotating the rebuilt keys needs the model's RoPE frequencies, bit for bit: a prefill whose tables
are not theirs is held materialized instead (the cache swaps the layer, see `rope_known`).
"""

from __future__ import annotations

import torch

from ..attention import CodedRead
from ..codec import PromptCode, attend_codes, compress_prompt, decode_prompt, matmul_dtype, tensor_bytes
from .base import VarRateLayer, kept_after_crop
from .footprint import LayerFootprint
from .rows import covers, slots_of
from .turns import Turn, exact_pieces


class CompactLayer(VarRateLayer):
    storage = "compact"

    @property
    def compact(self) -> bool:
        return bool(self.codes)

    def _store(self, rows, coding, scaling, keys, values, share) -> None:
        for row in rows:
            code = compress_prompt(row.keys, row.values, row.queries, row.cos, row.sin, coding[0], self.config,
                                   scaling, reconstruct=False, scales=coding[1], layer_share=share)[0]
            exact = code.exact_pos
            code.exact_keys = row.keys.index_select(2, exact)  # copies: the prompt's tensors are not kept
            code.exact_values = row.values.index_select(2, exact)
            self.codes.append(code)
            self.spans.append(row.span)
        batch, heads, _, dim = keys.shape
        self.keys = keys.new_empty(batch, heads, 0, dim)
        self.values = keys.new_empty(batch, heads, 0, dim)

    def _adopt(self, layer) -> None:
        """From a materialized layer: keep each row's exact tokens and the appended tail, drop the rest."""
        reason = layer.rope_known()
        if reason:
            raise ValueError(f"layer {self.layer_idx} cannot go compact: {reason}")
        for b, code in enumerate(self.codes):
            code.exact_keys, code.exact_values = layer.exact_tokens(b)  # advanced indexing: copies
        for turn in self.turns:
            for b, code in enumerate(turn.codes):
                code.exact_keys, code.exact_values = layer.turn_exact_tokens(turn, b)
        keys, values = layer.appended_tokens()
        self.keys, self.values = keys.clone(), values.clone()  # views would pin the materialized K/V

    @classmethod
    def from_tensors(cls, template: VarRateLayer, info: dict, tensors: dict, prefix: str, device) -> CompactLayer:
        """A layer like `template` (same index, bases, config, RoPE) holding what `to_tensors` wrote under
        `prefix` (checked beforehand by `cache_checks.check_layers`), on `device`."""
        layer = cls(template.layer_idx, template.bases, template.config, template.rope, template.memo)
        tail_k = tensors[f"{prefix}.appended_keys"].to(device)
        tail_v = tensors[f"{prefix}.appended_values"].to(device)
        layer.lazy_initialization(tail_k, tail_v)
        layer.prefilled = True
        layer.prompt_len, layer.prompt_kept, layer.appended = info["prompt_len"], info["prompt_kept"], info["appended"]
        for b, row in enumerate(info["rows"]):
            named = {name.removeprefix(f"{prefix}.rows.{b}."): t for name, t in tensors.items()
                     if name.startswith(f"{prefix}.rows.{b}.")}
            layer.codes.append(PromptCode.from_tensors(row, named, device))
            layer.spans.append(tuple(row["span"]) if row["span"] is not None else named["slots"].to(device))
            layer.offsets.append(row["rope_offset"])
        for t, turn in enumerate(info.get("turns", [])):
            named = {name.removeprefix(f"{prefix}.turns.{t}."): tensor for name, tensor in tensors.items()
                     if name.startswith(f"{prefix}.turns.{t}.")}
            layer.turns.append(Turn.from_tensors(turn, named, device))
        layer.keys, layer.values = tail_k, tail_v
        return layer

    # updates and reads -----------------------------------------------------------------------------------
    def _append(self, key_states, value_states):
        if not self.codes:
            return super()._append(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if self.attends_codes(None) and not torch.compiler.is_compiling():
            return CodedRead.pair(self)  # sdpa reads it over the codes; any other use rebuilds it (`read`)
        return self.read()

    def get_seq_length(self) -> int:
        if self.codes:
            return self.prompt_kept + self.appended
        return super().get_seq_length()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V [B, H, kept + appended, d]: the prompt reconstructed from its codes, then
        the appended tokens. Padding slots are zeros (the attention mask hides them)."""
        if not self.codes:
            return self.keys, self.values
        batch, heads, _, dim = self.keys.shape
        kept = self.prompt_kept
        shape = (batch, heads, kept + self.appended, dim)
        keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
        if any(not covers(span, kept) for span in self.spans):
            keys[:, :, :kept].zero_()
            values[:, :, :kept].zero_()
        basis, scales = self.bases.coding_basis(self.layer_idx, self.config.balance, self.keys.device,
                                                key_weight=self.config.key_weight, bits=self.config.basis_bits)
        for b, (code, span) in enumerate(zip(self.codes, self.spans)):
            cos, sin = self.memo.tables(self.rope, code.seq_len, self.keys.dtype, self.keys.device, self.offsets[b])
            args = (code, code.exact_keys, code.exact_values, cos, sin, basis)
            if isinstance(span, tuple) and span[1] <= kept:
                start, stop = span
                decode_prompt(*args, scales=scales, projection_dtype=self.config.projection_dtype,
                              out=(keys[b : b + 1, :, start:stop], values[b : b + 1, :, start:stop]))
                continue
            k_hat, v_hat = decode_prompt(*args, scales=scales, projection_dtype=self.config.projection_dtype)
            slots = slots_of(span, self.keys.device)
            keep = slots < kept
            keys[b, :, slots[keep]] = k_hat[0][:, keep]
            values[b, :, slots[keep]] = v_hat[0][:, keep]
        self._read_after_prompt(keys, values, basis, scales)
        return keys, values

    def _read_after_prompt(self, keys, values, basis, scales) -> None:
        """Fill slots prompt_kept.. of keys / values: the exact tokens, and each coded later turn rebuilt."""
        at = 0
        for start, stop in exact_pieces(self.turns, self.prompt_kept, keys.shape[-2]):
            keys[:, :, start:stop] = self.keys[:, :, at : at + stop - start]
            values[:, :, start:stop] = self.values[:, :, at : at + stop - start]
            at += stop - start
        for turn in self.turns:
            for b, code in enumerate(turn.codes):
                cos, sin = self.memo.tables(self.rope, code.seq_len, keys.dtype, keys.device, turn.offset)
                args = (code, code.exact_keys, code.exact_values, cos, sin, basis)
                k_hat, v_hat = decode_prompt(*args, scales=scales, projection_dtype=self.config.projection_dtype)
                keys[b : b + 1, :, turn.start : turn.stop] = k_hat[:, :, : turn.kept]
                values[b : b + 1, :, turn.start : turn.stop] = v_hat[:, :, : turn.kept]

    def attends_codes(self, mask) -> bool:
        """Whether `attend` can read this layer under `mask` (one unpadded, uncropped sequence whose prompt
        was coded, a mask shared by the heads); else the attention rebuilds K/V with `read`."""
        if len(self.codes) != 1 or self.codes[0].stored_exactly or not self.codes[0].ranks.numel() or self.turns:
            return False
        if self.prompt_kept != self.prompt_len or self.spans[0] != (0, self.prompt_len):
            return False
        return mask is None or (mask.dim() == 4 and mask.shape[:2] == (1, 1))

    def attend(self, query: torch.Tensor, mask, scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Attention of query [1, Hq, Q, d] over this layer, read from the codes (`codec.attend_codes`):
        [1, Hq, Q, d] in the query's dtype, as sdpa returns it."""
        code = self.codes[0]
        device = self.keys.device
        _, heads, _, dim = code.exact_keys.shape
        split = self.bases.attention_basis(self.layer_idx, self.config.balance, device, heads, dim,
                                           key_weight=self.config.key_weight, bits=self.config.basis_bits)
        turns = self.memo.turns(self.rope, code.seq_len, self.keys.dtype, device, self.offsets[0])
        out = attend_codes(code, query[0], code.exact_keys[0], code.exact_values[0], self.keys[0], self.values[0],
                           turns, split, scaling, mask=None if mask is None else mask[0, 0],
                           softcap=softcap, mm_dtype=matmul_dtype(self.config.projection_dtype, device))
        return out.to(query.dtype).unsqueeze(0)

    def exact_tokens(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's exact tokens [1, H, E, d], held by its code."""
        return self.codes[b].exact_keys, self.codes[b].exact_values

    def appended_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens after the prompt stored exactly (coded later turns left out)."""
        return self.keys, self.values

    def turn_exact_tokens(self, turn: Turn, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return turn.codes[b].exact_keys, turn.codes[b].exact_values

    def _turn_tokens(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self._tail_index(start)
        return self.keys[:, :, at : at + length], self.values[:, :, at : at + length]

    def _tail_index(self, slot: int) -> int:
        """Where slot `slot` (after the prompt, in no coded turn) sits in the exact tail `keys` / `values`."""
        return slot - self.prompt_kept - sum(turn.kept for turn in self.turns if turn.start < slot)

    def _store_turn(self, row, coding, scaling, share, start):
        code = compress_prompt(row.keys, row.values, row.queries, row.cos, row.sin, coding[0], self.config, scaling,
                               reconstruct=False, scales=coding[1], layer_share=share)[0]
        exact = code.exact_pos
        code.exact_keys, code.exact_values = row.keys.index_select(2, exact), row.values.index_select(2, exact)
        self.keys, self.values = self._tail(self.keys, self.values, self._tail_index(start))  # the turn leaves the tail
        return code

    # accounting and cache operations ---------------------------------------------------------------------
    def footprint(self) -> LayerFootprint:
        if not self.codes:  # never compressed: held exactly, like a DynamicLayer
            held = tensor_bytes(self.keys, self.values) if self.is_initialized else 0
            return LayerFootprint(self.layer_idx, "exact", held, held)
        full, tail, _ = self._full_bytes()
        held = sum(code.nbytes() for code in self.codes) + tensor_bytes(self.keys, self.values)
        held += sum(code.nbytes() for turn in self.turns for code in turn.codes)
        held += sum(tensor_bytes(span) for span in self.spans if torch.is_tensor(span))
        return LayerFootprint(self.layer_idx, "varrate", held, full, self.rows_stored_exactly, tail, held)

    def crop(self, tokens: int) -> None:
        """Crop as the installed transformers' DynamicLayer.crop reads `tokens` (`kept_after_crop`); a crop into
        the prompt keeps its codes and reads fewer of them."""
        if not self.codes:
            super().crop(tokens)
            return
        length = self.get_seq_length()
        keep = kept_after_crop(length, tokens)
        if keep == 0:  # nothing left: the next prompt is a new one, coded afresh
            self._empty()
            return
        self._crop_turns(keep)
        self.appended = max(keep - self.prompt_kept, 0)
        self.prompt_kept = min(self.prompt_kept, keep)
        exact = self.appended - sum(turn.kept for turn in self.turns)
        self.keys, self.values = self._tail(self.keys, self.values, exact)

    @staticmethod
    def _tail(keys, values, count: int, start: int = 0):
        """Copies of `count` token slots of keys / values from `start` (copies: views would pin the rest)."""
        pick = slice(start, start + count)
        return keys[..., pick, :].clone(), values[..., pick, :].clone()
