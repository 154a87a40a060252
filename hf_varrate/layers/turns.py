"""Later turns: a long run of new tokens that arrives after the prompt is coded too, as a segment of its own.

The rule (`VarRateLayer.update`): once the prompt is coded, what arrives in multi-token forwards after the last
one-token forward is a *turn* (a user message with a pasted document, or the chunks of one). It is held
exactly, and attended to exactly, until it is complete: at the next one-token forward, or
`VarRateCache.compress()`. Then, if it has at least `config.min_turn_tokens` tokens, it is coded alone, as a
prompt is (its own anchors, its last `window` tokens exact, salience from its last queries); a shorter one
(a question, a reply) stays exact. Tokens decoded one at a time always stay exact.

Turns are coded for a batch of one unpadded sequence; a padded batch keeps later turns exact. A turn whose RoPE
positions the cache cannot recompute (custom position ids, no recorded frequencies) stays exact too.

`Turn` is one coded turn: where it sits in the layer, each row's code and the RoPE position it starts at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codec import PromptCode
from .context import PrefillContext, crop_context, merge_contexts
from .rows import Row, row_inputs


@dataclass
class Turn:
    """A coded later turn: slots [start, start + kept) of the layer, coded as `codes[b]` for each row b (the same
    code for rows copied from one sequence); `offset` is the RoPE position of its first token."""

    start: int
    codes: list[PromptCode]
    offset: int
    kept: int

    @property
    def length(self) -> int:
        return self.codes[0].seq_len

    @property
    def stop(self) -> int:
        return self.start + self.kept

    def select_rows(self, rows: list[int]) -> Turn:
        return Turn(self.start, [self.codes[i] for i in rows], self.offset, self.kept)

    def to_tensors(self, exact: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON-able bookkeeping, tensors) of this turn, given each row's exact tokens [1, H, E, d]."""
        rows, tensors = [], {}
        for b, (code, (keys, values)) in enumerate(zip(self.codes, exact)):
            row, row_tensors = code.to_tensors(keys, values)
            rows.append(row)
            tensors.update({f"rows.{b}.{name}": t for name, t in row_tensors.items()})
        return {"start": self.start, "kept": self.kept, "rope_offset": self.offset, "rows": rows}, tensors

    @classmethod
    def from_tensors(cls, info: dict, tensors: dict[str, torch.Tensor], device) -> Turn:
        """The turn `to_tensors` wrote (checked beforehand by `cache_checks`); the codes hold their exact tokens."""
        codes = []
        for b, row in enumerate(info["rows"]):
            named = {name.removeprefix(f"rows.{b}."): t for name, t in tensors.items() if name.startswith(f"rows.{b}.")}
            codes.append(PromptCode.from_tensors(row, named, device))
        return cls(info["start"], codes, info["rope_offset"], info["kept"])


@dataclass
class HeldTurn:
    """A turn still arriving: its first slot and the merged context of its forwards."""

    start: int
    context: PrefillContext

    def extend(self, context: PrefillContext, window: int) -> None:
        self.context = merge_contexts(self.context, context, window)

    def crop(self, length: int) -> HeldTurn | None:
        """What is left of it when the layer is cropped to `length` tokens (None: nothing)."""
        if length <= self.start:
            return None
        return HeldTurn(self.start, crop_context(self.context, length - self.start))


def crop_turns(turns: list[Turn], length: int) -> list[Turn]:
    """The coded turns left when the layer keeps its first `length` tokens (a turn cut into keeps fewer tokens)."""
    left = []
    for turn in turns:
        if turn.start >= length:
            break
        turn.kept = min(turn.kept, length - turn.start)
        left.append(turn)
    return left


def exact_pieces(turns: list[Turn], first: int, stop: int) -> list[tuple[int, int]]:
    """The (start, stop) slot ranges in [first, stop) that no coded turn covers, in order."""
    pieces, at = [], first
    for turn in turns:
        if turn.start > at:
            pieces.append((at, turn.start))
        at = turn.stop
    if stop > at:
        pieces.append((at, stop))
    return pieces


class TurnsMixin:
    """What `VarRateLayer` does with later turns: hold one while it arrives, code it when complete, crop them.
    The storage modes hold a coded turn their own way (`_turn_tokens`, `_store_turn`)."""

    def takes_turns(self, batch: int) -> bool:
        """Whether a multi-token forward of `batch` rows now would be a later turn this layer may code."""
        return self.prefilled and bool(self.codes) and batch == 1 and self.config.min_turn_tokens is not None

    def _hold_turn(self, batch: int) -> None:
        context, self.prefill_context = self.prefill_context, None
        if context is None or context.key_valid is not None or not self.takes_turns(batch):
            self.held_turn = None  # padded, batched or without positions: the turn stays exact
        elif self.held_turn is None:
            self.held_turn = HeldTurn(self.get_seq_length(), context)
        else:
            self.held_turn.extend(context, self.config.obs_window)

    @property
    def turn_held(self) -> bool:
        return self.held_turn is not None

    def finish_turn(self) -> None:
        """Code the later turn held since the last one-token forward, if it is long enough (`layers.turns`)."""
        held, self.held_turn = self.held_turn, None
        length = self.get_seq_length() - held.start if held is not None else 0
        if held is None or length < self.config.min_turn_tokens or self.rope is None:
            return
        keys, values = self._turn_tokens(held.start, length)
        row = row_inputs(held.context, 0, keys, values)
        first = held.start + (self.offsets[0] or 0)
        offset = self.rope.offset_of(row.cos, row.sin, (first, held.start))
        if offset is None:  # not positions the cache can recompute: stays exact
            return
        coding = self.bases.coding_basis(self.layer_idx, self.config.balance, keys.device,
                                         key_weight=self.config.key_weight, bits=self.config.basis_bits)
        share = self.bases.layer_share(self.layer_idx, self.config, keys.dtype)
        code = self._store_turn(row, coding, held.context.scaling, share, held.start)
        self.turns.append(Turn(held.start, [code], offset, length))

    def _turn_tokens(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact K/V [1, H, length, d] of the held turn that starts at slot `start`."""
        raise NotImplementedError

    def _store_turn(self, row: Row, coding, scaling: float, share, start: int):
        """Code a complete later turn (slots start..) and hold it this storage mode's way; returns its code."""
        raise NotImplementedError

    def _crop_turns(self, length: int) -> None:
        """Keep the later turns (coded or held) within the first `length` tokens."""
        self.turns = crop_turns(self.turns, length)
        self.held_turn = self.held_turn.crop(length) if self.held_turn is not None else None

    def _turn_bytes(self) -> int:
        """Bytes of the coded later turns' codes (their tokens kept)."""
        return sum(code.nbytes(limit=turn.kept) for turn in self.turns for code in turn.codes)
