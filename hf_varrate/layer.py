"""`VarRateLayer`: one full-attention layer of a `VarRateCache`, in either storage mode.

Orchestration only; the arithmetic is in `hf_varrate.codec`. The layer's first update with more than
one token is the prefill: the prefill's own attention gets the exact K/V it was given, the layer
codes the prompt, and every later token is stored exactly.

- materialized: the reconstruction replaces the prompt once; `keys` / `values` hold full-length
  K/V like a DynamicLayer (and `codes` the codes, for `footprint()` and `save_pretrained`).
- compact: only the codes and exact tokens are held (`codes[b].exact_keys` ...); `keys` / `values`
  hold the tokens appended after the prefill; every read reconstructs this layer's prompt, except
  under the "varrate" attention implementation (`hf_varrate.attention`), which attends over the codes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from .attention import CodedRead
from .bases import Bases
from .binding import PrefillContext
from .codec import PromptCode, attend_codes, compress_prompt, decode_prompt
from .codec.balance import coding_basis, layer_share
from .codec.projection import matmul_dtype
from .config import VarRateConfig
from .rotary import RopeMemo, RotaryFrequencies

UNBOUND_MESSAGE = (
    "VarRateCache needs the model bound to it to see the prefill's queries: build the cache with "
    "VarRateCache.from_pretrained(bases, model=model) or call hf_varrate.bind(model) before generate()"
)


class VarRateWarning(UserWarning):
    """Something the codec did differently from what was asked, without losing data."""


@dataclass
class LayerFootprint:
    layer_idx: int
    kind: str  # "varrate", "sliding" or "exact"
    bytes: int
    full_bytes: int
    rows_stored_exactly: int = 0
    appended_bytes: int = 0  # tokens added after the prefill, stored exactly (part of `bytes`)
    held_bytes: int | None = None  # bytes of the tensors the layer really holds (None: same as `bytes`)

    @property
    def fraction(self) -> float:
        return self.bytes / self.full_bytes if self.full_bytes else 1.0

    @property
    def prompt_fraction(self) -> float:
        full = self.full_bytes - self.appended_bytes
        return (self.bytes - self.appended_bytes) / full if full else 1.0


@dataclass
class _Row:
    """One sequence's prefill inputs: its real tokens' slots and tensors (padding removed)."""

    span: tuple[int, int] | torch.Tensor  # (start, stop) slots, or the slots themselves if not contiguous
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class VarRateLayer(DynamicLayer):
    """One full-attention layer: compresses its prompt once, then grows exactly like a DynamicLayer.

    `codes[b]` is sequence b's `PromptCode`; `positions[b]` the cache slots of its real (non-padding)
    prompt tokens; `appended` counts tokens added after the prefill; `storage` is this layer's mode.
    """

    def __init__(self, layer_idx: int, bases: Bases, config: VarRateConfig, rope: RotaryFrequencies | None = None,
                 memo: RopeMemo | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.bases = bases
        self.config = config
        self.rope = rope
        self.memo = memo if memo is not None else RopeMemo()
        self.coded_reads = False  # set before each forward by the binding hook: the model's attention is "varrate"
        self._reset_state()

    def _reset_state(self):
        self.prefill_context: PrefillContext | None = None
        self.prefilled = False
        self.storage = self.config.storage
        self.codes: list[PromptCode] = []
        self._spans: list = []
        self._offsets: list[int | None] = []  # RoPE position of each row's first real token (None: unknown)
        self.prompt_len = 0  # cache slots of the prompt (padding included)
        self.prompt_kept = 0  # the same, after crops into the prompt
        self.appended = 0

    @property
    def awaits_prefill(self) -> bool:
        return not self.prefilled

    @property
    def compact(self) -> bool:
        return self.storage == "compact" and bool(self.codes)

    @property
    def positions(self) -> list[torch.Tensor]:
        return [_slots(span, self.device) for span in self._spans]

    @property
    def ranks(self):
        """Per-token ranks of the coded tokens: a LongTensor [C] for one sequence, a list for a batch."""
        ranks = [code.ranks.long() for code in self.codes]
        return ranks[0] if len(ranks) == 1 else ranks

    @property
    def rows_stored_exactly(self) -> int:
        return sum(code.stored_exactly for code in self.codes)

    def update(self, key_states, value_states, *args, **kwargs):
        coded_read, self.coded_reads = self.coded_reads, False  # armed by the hook for this forward only
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.prefilled and key_states.shape[-2] > 1:
            return self._prefill(key_states, value_states)
        if not self.prefilled:  # a one-token start: nothing to code, a plain DynamicLayer from here on
            self.prefilled, self.storage = True, "materialized"
            return super().update(key_states, value_states)
        self.appended += key_states.shape[-2]
        if not self.compact:
            return super().update(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if coded_read:
            read = CodedRead(self)
            return read, read
        return self._read()

    def get_seq_length(self) -> int:
        if self.compact:
            return self.prompt_kept + self.appended
        return super().get_seq_length()

    # prefill ---------------------------------------------------------------------------------------
    def _prefill(self, keys, values):
        context, self.prefill_context = self.prefill_context, None
        if context is None:
            raise RuntimeError(UNBOUND_MESSAGE)
        if not (_all_finite(keys) and _all_finite(values)):
            raise ValueError(
                f"layer {self.layer_idx}: keys or values contain NaN or inf at the prefill; VarRate refuses to "
                f"code them. Check the model's dtype (fp16 overflow?) and inputs"
            )
        self.prefilled = True  # only now: after a refused prefill the cache still awaits one (a retry compresses)
        self.prompt_len = self.prompt_kept = keys.shape[-2]
        rows = [_row_inputs(context, b, keys, values) for b in range(keys.shape[0])]
        self._offsets = [self._rope_offset(row) for row in rows]
        if self.storage == "compact" and not self._rope_fits():
            self.storage = "materialized"
        coding = coding_basis(self.bases, self.layer_idx, self.config.balance, keys.device)  # (basis, scales)
        share = layer_share(self.bases, self.layer_idx, self.config)  # per-layer budgets, or None
        if self.storage == "compact":
            self._prefill_compact(rows, coding, context.scaling, keys, share)
        else:
            self._prefill_materialized(rows, coding, context.scaling, keys, values, share)
        return keys, values  # the prefill attends to the exact K/V

    def _prefill_materialized(self, rows, coding, scaling, keys, values, share=None):
        self.keys, self.values = keys, values
        whole = len(rows) == 1 and rows[0].span == (0, keys.shape[-2])
        for b, row in enumerate(rows):
            code, k_hat, v_hat = compress_prompt(row.keys, row.values, row.queries, row.cos, row.sin, coding[0],
                                                 self.config, scaling, scales=coding[1], layer_share=share)
            self.codes.append(code)
            self._spans.append(row.span)
            if k_hat is None:
                continue
            if whole:
                self.keys, self.values = k_hat, v_hat
                continue
            if self.keys is keys:
                self.keys, self.values = keys.clone(), values.clone()
            _place(self.keys[b : b + 1], row.span, k_hat)
            _place(self.values[b : b + 1], row.span, v_hat)

    def _prefill_compact(self, rows, coding, scaling, keys, share=None):
        for row in rows:
            code = compress_prompt(row.keys, row.values, row.queries, row.cos, row.sin, coding[0], self.config,
                                   scaling, reconstruct=False, scales=coding[1], layer_share=share)[0]
            exact = code.exact_pos
            code.exact_keys = row.keys.index_select(2, exact)  # copies: the prompt's tensors are not kept
            code.exact_values = row.values.index_select(2, exact)
            self.codes.append(code)
            self._spans.append(row.span)
        batch, heads, _, dim = keys.shape
        self.keys = keys.new_empty(batch, heads, 0, dim)
        self.values = keys.new_empty(batch, heads, 0, dim)

    def _rope_offset(self, row: _Row) -> int | None:
        """Where row's RoPE positions start: 0 (as `generate` numbers left-padded rows), or its first slot."""
        if self.rope is None or row.keys.shape[-2] == 0:
            return None if self.rope is None else 0
        start = row.span[0] if isinstance(row.span, tuple) else int(row.span[0])
        return self.rope.offset_of(row.cos, row.sin, (0, start) if start else (0,))

    def _rope_fits(self) -> bool:
        """Compact storage re-rotates with recomputed tables: only if they are the model's, bit for bit."""
        reason = None
        if self.rope is None:
            reason = "the cache has no rotary frequencies (build it with model=model)"
        elif any(offset is None for offset in self._offsets):
            reason = "the model's RoPE tables are not consecutive positions of its inv_freq (custom position ids?)"
        if reason:
            warnings.warn(f"layer {self.layer_idx}: storage='compact' falls back to 'materialized': {reason}",
                          VarRateWarning, stacklevel=4)
        return reason is None

    # compact reads -----------------------------------------------------------------------------------
    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V [B, H, kept + appended, d]: the prompt reconstructed from its codes, then
        the appended tokens. Padding slots are zeros (the attention mask hides them)."""
        batch, heads, tail, dim = self.keys.shape
        kept = self.prompt_kept
        shape = (batch, heads, kept + tail, dim)
        keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
        if any(not _covers(span, kept) for span in self._spans):
            keys[:, :, :kept].zero_()
            values[:, :, :kept].zero_()
        basis, scales = coding_basis(self.bases, self.layer_idx, self.config.balance, self.keys.device)
        for b, (code, span) in enumerate(zip(self.codes, self._spans)):
            cos, sin = self.memo.tables(self.rope, code.seq_len, self.keys.dtype, self.keys.device, self._offsets[b])
            args = (code, code.exact_keys, code.exact_values, cos, sin, basis)
            if isinstance(span, tuple) and span[1] <= kept:
                start, stop = span
                decode_prompt(*args, scales=scales, projection_dtype=self.config.projection_dtype,
                              out=(keys[b : b + 1, :, start:stop], values[b : b + 1, :, start:stop]))
                continue
            k_hat, v_hat = decode_prompt(*args, scales=scales, projection_dtype=self.config.projection_dtype)
            slots = _slots(span, self.keys.device)
            keep = slots < kept
            keys[b, :, slots[keep]] = k_hat[0][:, keep]
            values[b, :, slots[keep]] = v_hat[0][:, keep]
        keys[:, :, kept:] = self.keys
        values[:, :, kept:] = self.values
        return keys, values

    def attends_codes(self, mask) -> bool:
        """Whether `attend` can read this layer under `mask` (one unpadded, uncropped sequence whose prompt
        was coded, a mask shared by the heads); else the attention rebuilds K/V with `_read`."""
        if len(self.codes) != 1 or self.codes[0].stored_exactly or not self.codes[0].ranks.numel():
            return False
        if self.prompt_kept != self.prompt_len or self._spans[0] != (0, self.prompt_len):
            return False
        return mask is None or (mask.dim() == 4 and mask.shape[:2] == (1, 1))

    def attend(self, query: torch.Tensor, mask, scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Attention of query [1, Hq, Q, d] over this layer, read from the codes (`codec.attend_codes`):
        [1, Q, Hq, d] in the query's dtype, as transformers' attention functions return it."""
        code = self.codes[0]
        device = self.keys.device
        basis, scales = coding_basis(self.bases, self.layer_idx, self.config.balance, device)
        turns = self.memo.turns(self.rope, code.seq_len, self.keys.dtype, device, self._offsets[0])
        out = attend_codes(code, query[0], code.exact_keys[0], code.exact_values[0], self.keys[0], self.values[0],
                           turns, basis, scaling, scales=scales, mask=None if mask is None else mask[0, 0],
                           softcap=softcap, mm_dtype=matmul_dtype(self.config.projection_dtype, device))
        return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous()

    # switching storage -------------------------------------------------------------------------------
    def exact_tokens(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's exact tokens [1, H, E, d] (held by its code in compact storage, in `keys` otherwise)."""
        code = self.codes[b]
        if code.exact_keys is not None:
            return code.exact_keys, code.exact_values
        if self.prompt_kept < self.prompt_len:
            raise ValueError(f"layer {self.layer_idx} was cropped into its compressed prompt in materialized storage, "
                             f"which dropped exact tokens its codes need")
        slots = _slots(self._spans[b], self.keys.device)[code.exact_pos]
        return self.keys[b : b + 1, :, slots], self.values[b : b + 1, :, slots]

    def set_storage(self, storage: str) -> None:
        """Switch this (prefilled) layer to 'compact' or 'materialized' in place; same tokens either way."""
        if storage not in ("compact", "materialized"):
            raise ValueError(f"storage must be 'compact' or 'materialized', got {storage!r}")
        if storage == self.storage or not self.codes:  # nothing coded: a plain layer either way
            return
        if storage == "compact":
            if self.rope is None or any(offset is None for offset in self._offsets):
                raise ValueError(f"layer {self.layer_idx} cannot go compact: its RoPE positions are unknown (build "
                                 f"the cache with model=model)")
            for b, code in enumerate(self.codes):
                code.exact_keys, code.exact_values = self.exact_tokens(b)  # advanced indexing: copies
            self.keys, self.values = self._tail(self.appended, start=self.prompt_kept)
            self.storage = "compact"
            return
        self.keys, self.values = self._read()
        for code in self.codes:
            code.exact_keys = code.exact_values = None
        self.storage = "materialized"

    # accounting ------------------------------------------------------------------------------------
    def footprint(self) -> LayerFootprint:
        if not self.codes:  # never compressed: held exactly, like a DynamicLayer
            held = _tensor_bytes(self.keys, self.values) if self.is_initialized else 0
            return LayerFootprint(self.layer_idx, "exact", held, held)
        per_token = self.codes[0].width * self.codes[0].kv_bytes
        kept = [int((_slots(span, "cpu") < self.prompt_kept).sum()) for span in self._spans]
        tail = self.appended * len(self.codes) * per_token
        full = sum(kept) * per_token + tail
        if self.compact:  # what is held: the codes, the appended tokens, non-contiguous slots
            held = sum(code.nbytes() for code in self.codes) + _tensor_bytes(self.keys, self.values)
            held += sum(_tensor_bytes(span) for span in self._spans if torch.is_tensor(span))
            return LayerFootprint(self.layer_idx, "varrate", held, full, self.rows_stored_exactly, tail, held)
        stored = sum(code.nbytes(limit=n) for code, n in zip(self.codes, kept))
        held = _tensor_bytes(self.keys, self.values) + sum(
            _tensor_bytes(*code.held_tensors()) for code in self.codes)
        return LayerFootprint(self.layer_idx, "varrate", stored + tail, full, self.rows_stored_exactly, tail, held)

    # cache operations: the tensors follow DynamicLayer, the per-sequence codes follow the tensors ----------
    def reset(self) -> None:
        super().reset()
        # transformers < 5.24 zeroes the tensors in DynamicLayer.reset; a reset layer must await a
        # new prefill with nothing held, as it does on newer versions.
        self.keys = self.values = None
        self.is_initialized = False
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        if not self.compact:
            length = self.get_seq_length()
            super().crop(tokens_to_remove)
            removed = length - self.get_seq_length()
            self.prompt_kept = min(self.prompt_kept, self.get_seq_length())
            self.appended = max(self.appended - removed, 0)
            return
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        removed = min(-tokens_to_remove, self.get_seq_length())
        from_tail = min(removed, self.appended)
        self.keys, self.values = self._tail(self.appended - from_tail)
        self.appended -= from_tail
        self.prompt_kept -= removed - from_tail

    def _tail(self, count: int, start: int = 0):
        """Copies of `count` token slots of keys / values from `start` (copies: views would pin the rest)."""
        pick = slice(start, start + count)
        return self.keys[..., pick, :].clone(), self.values[..., pick, :].clone()

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
        if self.codes:
            self.codes = [self.codes[i] for i in rows]
            self._spans = [self._spans[i] for i in rows]
            self._offsets = [self._offsets[i] for i in rows]


def _row_inputs(context: PrefillContext, b: int, keys, values) -> _Row:
    """Row b's real tokens: a (start, stop) span when they are contiguous (no copy), else their slots."""
    seq_len = keys.shape[-2]
    cos, sin = _row(context.cos, b), _row(context.sin, b)
    if context.key_valid is None:
        span = (0, seq_len)
    else:
        slots = context.key_valid[b].nonzero()[:, 0].to(keys.device)
        contiguous = slots.numel() == 0 or int(slots[-1] - slots[0]) + 1 == slots.numel()
        span = (int(slots[0]), int(slots[-1]) + 1) if contiguous and slots.numel() else slots
        if slots.numel() == 0:
            span = (seq_len, seq_len)
    if isinstance(span, tuple):
        pick = slice(*span)
        k, v, c, s = keys[b : b + 1, :, pick], values[b : b + 1, :, pick], cos[:, pick], sin[:, pick]
    else:
        k, v, c, s = keys[b : b + 1, :, span], values[b : b + 1, :, span], cos[:, span], sin[:, span]
    queries = _row(context.queries, b)
    n = k.shape[-2]
    queries = queries[:, :, -min(queries.shape[2], n) :] if n else queries[:, :, :0]
    return _Row(span, k, v, queries, c, s)


def _row(tensor: torch.Tensor, b: int) -> torch.Tensor:
    """Row b of a [B or 1, ...] tensor, keeping the batch dim (cos/sin may be shared across rows)."""
    return tensor[b : b + 1] if tensor.shape[0] > 1 else tensor


def _slots(span, device) -> torch.Tensor:
    if isinstance(span, tuple):
        return torch.arange(*span, device=device)
    return span.to(device)


def _covers(span, kept: int) -> bool:
    return isinstance(span, tuple) and span == (0, kept)


def _place(target: torch.Tensor, span, rows: torch.Tensor) -> None:
    """target[:, :, span] = rows, for target [1, H, S, d]."""
    if isinstance(span, tuple):
        target[:, :, span[0] : span[1]] = rows
    else:
        target[:, :, span] = rows


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in `tensor`, in two passes (amax propagates NaN) instead of isfinite's four."""
    return tensor.numel() == 0 or bool(torch.isfinite(tensor.abs().amax()))


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
