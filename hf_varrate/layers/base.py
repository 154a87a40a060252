"""`VarRateLayer`: what both storage modes of a full-attention layer share, the prefill above all.

Orchestration only; the arithmetic is in `hf_varrate.codec`. The prompt is what arrives in multi-token
forwards while the layer is empty (one prefill, or a chunked prefill's chunks): it is held (`layers.held`:
a float32 model's in float16) until it is complete: at the first one-token forward (decoding), or when the
cache is asked (`VarRateCache.compress`, and what reads or copies the codes). Then the layer codes it as
one prompt (`finish_prompt`). A long later turn is coded the same way, as a segment of its own
(`hf_varrate.layers.turns`); tokens decoded one at a time are stored exactly. How the coded prompt is held
is the subclass's one job (`MaterializedLayer`, `CompactLayer`): `_store` when it is coded, `_append`
afterwards, `read`, `exact_tokens`, `footprint` and `crop`. A cache switches storage by swapping layer
objects (`from_layer`); a saved cache's layers round-trip through `to_tensors` / `from_tensors`.
"""

from __future__ import annotations

import inspect
import math

import torch
from transformers.cache_utils import DynamicLayer

from ..bases import Bases
from ..codec import PromptCode
from ..config import VarRateConfig
from ..devices import check_arrival
from ..errors import CacheFileError
from ..rotary import RopeMemo, RotaryFrequencies
from .context import PrefillContext, crop_context, merge_contexts, select_context
from .footprint import LayerFootprint
from .held import append_held
from .rows import Row, magnitude, row_inputs, slots_of
from .turns import HeldTurn, Turn, TurnsMixin

UNBOUND_MESSAGE = (
    "VarRateCache needs the model bound to it to see the prefill's queries (a query-aware signal, or bases "
    "that record no RoPE frequencies): build the cache with VarRateCache.from_pretrained(bases, model=model) "
    "or call hf_varrate.bind(model) before generate()"
)


# transformers < 5.24 crops to a length (crop(max_length), negative: remove that many); newer ones remove
# tokens (crop(tokens_to_remove), negative; 0 does nothing; positive is an error). Layers follow the installed one.
CROP_KEEPS_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters


def kept_after_crop(length: int, tokens: int) -> int:
    """How many of `length` tokens `crop(tokens)` keeps, read as the installed DynamicLayer.crop reads it."""
    if tokens < 0:
        return max(length + tokens, 0)
    if CROP_KEEPS_LENGTH:
        return min(tokens, length)
    if tokens > 0:
        raise ValueError(f"crop takes a negative number of tokens to remove (transformers >= 5.24), got {tokens}")
    return length


class VarRateLayer(TurnsMixin, DynamicLayer):
    """One full-attention layer: compresses its prompt once, then grows like a DynamicLayer.

    `codes[b]` is sequence b's `PromptCode`; `spans[b]` the cache slots of its real (non-padding)
    prompt tokens ((start, stop) or a LongTensor of slots); `offsets[b]` the RoPE position of its first
    real token (None: unknown); `appended` counts tokens added after the prefill.
    """

    storage: str = ""  # "materialized" or "compact", per subclass

    def __init__(self, layer_idx: int, bases: Bases, config: VarRateConfig, rope: RotaryFrequencies | None = None,
                 memo: RopeMemo | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.bases = bases
        self.config = config
        self.rope = rope
        self.memo = memo if memo is not None else RopeMemo()
        self._reset_state()

    def _reset_state(self):
        self.prefill_context: PrefillContext | None = None  # this forward's, handed over by the binding hook
        self.held_context: PrefillContext | None = None  # the held prompt's, merged over its forwards
        self.prefilled = False
        self.codes: list[PromptCode] = []
        self.spans: list = []
        self.offsets: list[int | None] = []
        self.prompt_len = 0  # cache slots of the prompt (padding included)
        self.prompt_kept = 0  # the same, after crops into the prompt
        self.appended = 0  # tokens after the prompt, coded later turns included
        self.turns: list[Turn] = []  # coded later turns, in order
        self.held_turn: HeldTurn | None = None  # a later turn still arriving
        # the K/V dtype of the model's forwards (the held prompt's may differ)
        self.model_dtype: torch.dtype | None = None

    @classmethod
    def from_layer(cls, layer: VarRateLayer) -> VarRateLayer:
        """This storage mode's layer holding `layer`'s tokens (the same ones): how a cache switches storage."""
        if type(layer) is cls:
            return layer
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        if layer.codes:
            new._adopt(layer)
        return new

    def _adopt(self, layer: VarRateLayer) -> None:
        """Take over `layer`'s coded prompt (already in self.__dict__), held the other way."""
        raise NotImplementedError

    # state -------------------------------------------------------------------------------------------
    @property
    def awaits_prefill(self) -> bool:
        return not self.prefilled

    @property
    def compact(self) -> bool:
        """Whether only codes and exact tokens are held (a prefilled `CompactLayer`)."""
        return False

    @property
    def positions(self) -> list[torch.Tensor]:
        return [slots_of(span, self.device) for span in self.spans]

    @property
    def ranks(self):
        """Per-token ranks of the coded tokens: a LongTensor [C] for one sequence, a list for a batch."""
        ranks = [code.ranks.long() for code in self.codes]
        return ranks[0] if len(ranks) == 1 else ranks

    @property
    def rows_stored_exactly(self) -> int:
        return sum(code.stored_exactly for code in self.codes)

    # updates -----------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_arrival(self, key_states, value_states, walk=not self.appended)  # walks the codes once, then compares
        if not self.prefilled and key_states.shape[-2] > 1:
            return self._hold(key_states, value_states)
        if self.holding:  # decoding starts: the prompt is complete
            self.finish_prompt()
        elif not self.prefilled:  # a one-token start: nothing to code, a plain DynamicLayer from here on
            self.prefilled = True
            return super().update(key_states, value_states)
        if key_states.shape[-2] > 1:  # a later turn, or one chunk of it: held exactly until it is complete
            self._hold_turn(key_states.shape[0])
        else:
            self.finish_turn()
        self.appended += key_states.shape[-2]
        return self._append(key_states, value_states)

    def _append(self, key_states, value_states):
        return super().update(key_states, value_states)

    @property
    def holding(self) -> bool:
        """Whether a prompt is held, to be coded when it is complete (`finish_prompt`)."""
        return self.held_context is not None and not self.prefilled

    def _hold(self, keys, values):
        """A prompt, or one chunk of it: held until it is complete (a forward attends to its own tokens exactly)."""
        context, self.prefill_context = self.prefill_context, None
        if context is None:
            raise RuntimeError(UNBOUND_MESSAGE)
        peak = magnitude(keys, values)  # also tells `append_held` whether they fit float16
        if not math.isfinite(peak):
            raise ValueError(f"layer {self.layer_idx}: keys or values contain NaN or inf at the prefill; VarRate "
                             f"refuses to code them. Check the model's dtype (fp16 overflow?) and inputs")
        held = self.held_context
        self.held_context = context if held is None else merge_contexts(held, context, self.config.obs_window)
        self.model_dtype = keys.dtype
        self.keys, self.values, keys, values = append_held(self.keys, self.values, keys, values, self.config, peak)
        return keys, values

    def finish_prompt(self) -> None:
        """Code the held prompt: every multi-token forward since the layer was empty, as if it had come in one
        (the window queries are the last `obs_window` of them all). Does nothing when no prompt is held."""
        if not self.holding:
            return
        context, self.held_context = self.held_context, None
        keys, values = self.keys.to(self.model_dtype), self.values.to(self.model_dtype)  # held narrower, maybe
        self.prefilled = True
        self.prompt_len = self.prompt_kept = keys.shape[-2]
        rows = [row_inputs(context, b, keys, values) for b in range(keys.shape[0])]
        self.offsets = [self._rope_offset(row) for row in rows]
        coding = self.bases.coding_basis(self.layer_idx, self.config.balance, keys.device,
                                         key_weight=self.config.key_weight, bits=self.config.basis_bits)
        share = self.bases.layer_share(self.layer_idx, self.config, keys.dtype)  # per-layer budgets, or None
        self._store(rows, coding, context.scaling, keys, values, share)

    def _store(self, rows: list[Row], coding, scaling: float, keys, values, share) -> None:
        """Code every row's prompt and hold the result (this storage mode's way)."""
        raise NotImplementedError

    def _rope_offset(self, row: Row) -> int | None:
        """Where row's RoPE positions start: 0 (as `generate` numbers left-padded rows), or its first slot."""
        if self.rope is None or row.keys.shape[-2] == 0:
            return None if self.rope is None else 0
        start = row.span[0] if isinstance(row.span, tuple) else int(row.span[0])
        return self.rope.offset_of(row.cos, row.sin, (0, start) if start else (0,))

    def rope_known(self) -> str | None:
        """Why compact storage could not re-rotate this layer's keys with recomputed RoPE tables (they must be
        the model's, to within rounding), or None if it can: for the coded prompt, or for the held one."""
        if self.rope is None:
            return "the cache has no rotary frequencies (build it with model=model)"
        offsets, detail = self.offsets, ""
        if self.holding:
            rows = [row_inputs(self.held_context, b, self.keys, self.values) for b in range(self.keys.shape[0])]
            offsets = [self._rope_offset(row) for row in rows]
            missed = [row for row, offset in zip(rows, offsets) if offset is None]
            if missed:
                worst, token, channel = self.rope.worst_difference(missed[0].cos, missed[0].sin)
                detail = (f"; at offset 0 they differ from ours by {worst:.3g}x rounding (most at token {token}, "
                          f"channel {channel})")
        if any(offset is None for offset in offsets):
            return ("the model's RoPE tables are not consecutive positions of its inv_freq (custom position ids?)"
                    + detail)
        return None

    # reads -------------------------------------------------------------------------------------------
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V [B, H, tokens, d] as attention reads them."""
        return self.keys, self.values

    def exact_tokens(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's exact tokens [1, H, E, d]."""
        raise NotImplementedError

    def footprint(self) -> LayerFootprint:
        raise NotImplementedError

    def _full_bytes(self) -> tuple[int, int, list[int]]:
        """(full K/V bytes of what is held, bytes of the appended tokens stored exactly, each row's prompt tokens
        kept)."""
        per_token = self.codes[0].width * self.codes[0].kv_bytes
        kept = [int((slots_of(span, "cpu") < self.prompt_kept).sum()) for span in self.spans]
        rows = len(self.codes)
        exact = (self.appended - sum(turn.kept for turn in self.turns)) * rows * per_token
        return (sum(kept) + self.appended * rows) * per_token, exact, kept

    # cache operations: the tensors follow DynamicLayer, the per-sequence codes follow the tensors -------
    def reset(self) -> None:
        super().reset()
        # transformers < 5.24 zeroes the tensors in DynamicLayer.reset; a reset layer must await a
        # new prefill with nothing held, as it does on newer versions.
        self.keys = self.values = None
        self.is_initialized = False
        self._reset_state()

    def crop(self, tokens: int) -> None:
        """DynamicLayer's crop, keeping the prompt / appended bookkeeping (a crop may reach into the prompt);
        cropped to nothing, the layer awaits a new prompt."""
        length = self.get_seq_length()
        super().crop(tokens)
        if self.is_initialized and self.get_seq_length() == 0:
            self._empty()
            return
        if self.holding:
            self.held_context = crop_context(self.held_context, self.get_seq_length())
        self._crop_turns(self.get_seq_length())
        removed = length - self.get_seq_length()
        self.prompt_kept = min(self.prompt_kept, self.get_seq_length())
        self.appended = max(self.appended - removed, 0)

    def _empty(self) -> None:
        """No tokens held: empty K/V (dtype and device kept) and no codes, awaiting a new prompt."""
        self.keys, self.values = self.keys[..., :0, :].clone(), self.values[..., :0, :].clone()
        self._reset_state()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_rows(beam_idx)
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = [i for i in range(len(self.codes)) for _ in range(repeats)]
        self._index_rows(torch.tensor(rows, dtype=torch.long))
        self._select_rows(rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.arange(len(self.codes))[indices.cpu() if torch.is_tensor(indices) else indices]
        self._index_rows(rows)
        self._select_rows(rows.tolist())

    def _index_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized and self.keys is not None and (self.keys.numel() or self.compact):
            self.keys = self.keys.index_select(0, rows.to(self.keys.device))
            self.values = self.values.index_select(0, rows.to(self.values.device))

    def _select_rows(self, rows: list[int]) -> None:
        if self.holding:
            self.held_context = select_context(self.held_context, rows)
        if self.codes:
            self.codes = [self.codes[i] for i in rows]
            self.spans = [self.spans[i] for i in rows]
            self.offsets = [self.offsets[i] for i in rows]
            self.turns = [turn.select_rows(rows) for turn in self.turns]
        if self.held_turn is not None and rows != [0]:
            self.held_turn = None  # more rows than one sequence: the turn stays exact

    # saved caches --------------------------------------------------------------------------------------
    def to_tensors(self, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON-able bookkeeping, tensors named under `prefix`) of a prefilled layer with codes: each row's
        code and exact tokens, and the tokens appended after the prefill. `from_tensors` reads them back."""
        tensors: dict[str, torch.Tensor] = {}
        rows = []
        for b, code in enumerate(self.codes):
            if self.offsets[b] is None:
                raise CacheFileError(
                    f"layer {self.layer_idx} row {b}: its keys were rotated at positions the cache did not record (no "
                    f"rotary frequencies, or custom position ids), so it cannot be rebuilt; build the cache with "
                    f"model=model and let the model number the positions")
            row, row_tensors = code.to_tensors(*self.exact_tokens(b))
            span = self.spans[b]
            row.update(rope_offset=self.offsets[b], span=list(span) if isinstance(span, tuple) else None)
            if not isinstance(span, tuple):
                row_tensors["slots"] = span
            rows.append(row)
            tensors.update({f"{prefix}.rows.{b}.{name}": t for name, t in row_tensors.items()})
        turns = []
        for t, turn in enumerate(self.turns):
            turn_info, turn_tensors = turn.to_tensors([self.turn_exact_tokens(turn, b) for b in range(len(turn.codes))])
            turns.append(turn_info)
            tensors.update({f"{prefix}.turns.{t}.{name}": tensor for name, tensor in turn_tensors.items()})
        tail_k, tail_v = self.appended_tokens()
        tensors[f"{prefix}.appended_keys"], tensors[f"{prefix}.appended_values"] = tail_k, tail_v
        info = {"kind": "varrate", "prompt_len": self.prompt_len, "prompt_kept": self.prompt_kept,
                "appended": self.appended, "rows": rows, "dtype": str(tail_k.dtype).removeprefix("torch.")}
        if turns:
            info["turns"] = turns
        return info, tensors

    def appended_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens added after the prefill and stored exactly, [B, H, n, d]."""
        raise NotImplementedError

    def turn_exact_tokens(self, turn: Turn, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's exact tokens [1, H, E, d] of a coded later turn."""
        raise NotImplementedError
