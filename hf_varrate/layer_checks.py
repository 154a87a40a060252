"""Validation of a saved cache's layers, done before anything is built from them (`check_layers`): each
field's JSON type and range, each tensor's dtype and shape, and how they fit together (exact-token counts,
ranks vs coefficients, anchor indices, spans and RoPE positions, coded later turns, layer lengths, and the
same batch, tokens and dtype in every layer). Each failure is a `CacheFileError` naming the field or tensor,
what it holds, what was expected and the fix. The file-level checks are `hf_varrate.cache_checks`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from .codec.codes import AXES, BITS, packed_bytes, scale_count
from .errors import CacheFileError

TENSORS_NAME = "cache.safetensors"
CONFIG_NAME = "cache_config.json"
LAYER_KINDS = ("empty", "sliding", "exact", "varrate")
FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32,
                                                             torch.float64)}
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
MAX_INT = 2**31 - 1  # no count, length or setting of a saved cache comes near this
NOT_CONSISTENT = ("this is not a consistent saved cache (a writer's bug or a hand edit): save it again with "
                  "cache.save_pretrained(dir)")


# checking a saved cache's layers: every field's type and range, every tensor's dtype and shape, and how
# they fit together (exact-token counts, ranks vs coefficients, anchor indices, spans, lengths) ----------
def check_layers(cache, meta: dict, tensors: dict, folder: Path, dtype: torch.dtype | None = None) -> None:
    """Raise `CacheFileError` naming the first field or tensor that is not what `save_cache` writes.
    Non-empty layers must agree on batch size, sequence length and dtype (attention reads them together),
    that dtype must be the model's (`dtype`, when given), and every tensor of the file must belong to a layer."""
    tensors = _Recording(tensors)
    first = None  # ((batch, length, dtype) or None if empty, where) of layer 0
    for i, info in enumerate(meta["layers"]):
        ctx = _Where(folder, f"layers[{i}]", f"layers.{i}")
        layer = cache.layers[i]
        sliding = isinstance(layer, DynamicSlidingWindowLayer)
        allowed = ("empty", "sliding") if sliding else ("empty", "exact", "varrate")
        expect(info["kind"] in allowed, ctx.field("kind"), info["kind"], f"one of {list(allowed)} for this model's "
                f"{type(layer).__name__}")
        if info["kind"] == "varrate":
            found = _check_varrate(cache, i, info, tensors, ctx)
        elif info["kind"] in ("sliding", "exact"):
            found = _check_plain(cache, info, tensors, ctx)
        else:
            found = None
        first = first or (found, ctx)
        if found != first[0]:
            raise CacheFileError(f"{folder}: {ctx.json} holds (batch, tokens, dtype) = {_show(found)} but "
                                 f"{first[1].json} holds {_show(first[0])}, and every layer holds the same tokens; "
                                 f"{NOT_CONSISTENT}")
    unused = sorted(set(tensors) - tensors.read - {"rope.inv_freq"})
    if unused:
        raise CacheFileError(f"{folder / TENSORS_NAME} holds tensors no layer of {CONFIG_NAME} uses: "
                             f"{unused[:5]}{' ...' if len(unused) > 5 else ''}; {NOT_CONSISTENT}")
    saved = first[0][2] if first and first[0] else None
    if dtype is not None and saved is not None and saved != dtype:
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        raise CacheFileError(f"{folder} holds {name(saved)} keys and values but the model runs in {name(dtype)}, "
                             f"and attention needs both in one dtype; load the model in {name(saved)} (e.g. "
                             f"from_pretrained(..., dtype=torch.{name(saved)})), or save the cache from a "
                             f"{name(dtype)} model")


def _check_plain(cache, info: dict, tensors: dict, ctx: _Where) -> tuple:
    """A sliding layer or an uncompressed full-attention layer: keys and values as they were."""
    keys = _check_kv(cache, tensors, ctx, "keys", "values")
    length = keys.shape[2]
    if info["kind"] == "sliding":
        length = _int(info, "cumulative_length", ctx, low=keys.shape[2])  # sliding layers keep only the last tokens
    return keys.shape[0], length, keys.dtype


def _check_varrate(cache, i: int, info: dict, tensors: dict, ctx: _Where) -> tuple:
    prompt_len = _int(info, "prompt_len", ctx, low=1)
    prompt_kept = _int(info, "prompt_kept", ctx, high=prompt_len)
    dtype = FLOAT_DTYPES.get(info["dtype"]) if isinstance(info.get("dtype"), str) else None
    expect(dtype is not None, ctx.field("dtype"), info.get("dtype"), f"one of {sorted(FLOAT_DTYPES)}")
    tail = _check_kv(cache, tensors, ctx, "appended_keys", "appended_values", dtype=dtype)
    appended = _int(info, "appended", ctx, low=tail.shape[2])
    in_turns = _check_turns(cache, i, info, tensors, ctx, dtype, batch=tail.shape[0],
                            after=(prompt_kept, prompt_kept + appended))
    expect(appended == tail.shape[2] + in_turns, ctx.field("appended"), appended,
           f"{tail.shape[2] + in_turns} (the exact tokens of {ctx.tensor('appended_keys')} and those of the coded "
           f"later turns)")
    rows = info.get("rows")
    expect(isinstance(rows, list) and len(rows) == tail.shape[0] and rows, ctx.field("rows"), rows,
            f"a non-empty list of {tail.shape[0]} rows (the batch size of {ctx.tensor('appended_keys')})")
    basis = cache.bases.tensors[i]
    rank = min(cache.config.rank or basis.shape[0], basis.shape[0], cache.model_shape.width)
    for b, row in enumerate(rows):  # each row ends within prompt_len; a right-padded batch ends before it
        _check_row(cache, row, tensors, ctx.row(b), prompt_len, dtype, rank)
    return tail.shape[0], prompt_kept + appended, dtype


def _check_turns(cache, i: int, info: dict, tensors: dict, ctx: _Where, dtype, batch: int, after: tuple) -> int:
    """The coded later turns (optional): in order, within slots [after[0], after[1]), one code per row, each
    turn's tokens kept at most its length. Returns the tokens they cover."""
    turns = info.get("turns", [])
    expect(isinstance(turns, list), ctx.field("turns"), turns, "a list of coded later turns")
    basis = cache.bases.tensors[i]
    rank = min(cache.config.rank or basis.shape[0], basis.shape[0], cache.model_shape.width)
    at, covered = after[0], 0
    for t, turn in enumerate(turns):
        where = _Where(ctx.folder, f"{ctx.json}.turns[{t}]", f"{ctx.prefix}.turns.{t}")
        expect(isinstance(turn, dict), where.node(), turn, "an object (one coded later turn)")
        start = _int(turn, "start", where, low=at, high=after[1] - 1)
        kept = _int(turn, "kept", where, low=1, high=after[1] - start)
        _int(turn, "rope_offset", where)
        rows = turn.get("rows")
        expect(isinstance(rows, list) and len(rows) == batch, where.field("rows"), rows, f"a list of {batch} rows")
        for b, row in enumerate(rows):
            row_where = where.row(b)
            seq_len = _check_code(cache, row, tensors, row_where, MAX_INT, dtype, rank)
            expect(kept <= seq_len, where.field("kept"), kept, f"at most the turn's {seq_len} tokens")
        at, covered = start + kept, covered + kept
    return covered


def _check_row(cache, row, tensors: dict, ctx: _Where, prompt_len: int, dtype, rank: int) -> None:
    """One sequence's code, its real tokens within the prompt's `prompt_len` slots."""
    seq_len = _check_code(cache, row, tensors, ctx, prompt_len, dtype, rank)
    first = _check_span(row, tensors, ctx, seq_len, prompt_len)
    expect(type(row.get("rope_offset")) is int and row["rope_offset"] in (0, first), ctx.field("rope_offset"),
           row.get("rope_offset"), f"{'0 or ' if first else ''}{first} (where the row's RoPE positions start)")


def _check_code(cache, row, tensors: dict, ctx: _Where, max_len: int, dtype, rank: int) -> int:
    """One sequence's code of at most `max_len` tokens and its exact tokens; returns its length."""
    expect(isinstance(row, dict), ctx.node(), row, "an object (one sequence's code)")
    seq_len = _int(row, "seq_len", ctx, high=max_len)
    stride, window = _int(row, "stride", ctx, low=1), _int(row, "window", ctx, low=1)
    width = cache.model_shape.width
    _int(row, "width", ctx, low=width, high=width)
    kv_bytes = torch.empty(0, dtype=dtype).element_size()
    _int(row, "kv_bytes", ctx, low=kv_bytes, high=kv_bytes)
    expect(isinstance(row.get("stored_exactly"), bool), ctx.field("stored_exactly"), row.get("stored_exactly"),
            "true or false")
    n_exact = seq_len if row["stored_exactly"] else _exact_count(seq_len, stride, window)
    _check_kv(cache, tensors, ctx, "exact_keys", "exact_values", dtype=dtype, batch=1, tokens=n_exact)
    if not row["stored_exactly"]:
        _check_codes(row, tensors, ctx, seq_len - n_exact, -(-seq_len // stride), dtype, rank)
    return seq_len


def _check_codes(row: dict, tensors: dict, ctx: _Where, n_coded: int, n_anchors: int, dtype, rank: int) -> None:
    """neighbours [C, c] index the anchors, ranks [C] lie in [0, R], the coefficients number sum(ranks)."""
    neighbours = _tensor(tensors, ctx, "neighbours", INT_DTYPES, (n_coded, None))
    expect(1 <= neighbours.shape[1] <= n_anchors, ctx.tensor("neighbours"), _describe(neighbours),
            f"1 to {n_anchors} anchor indices per coded token")
    _check_values(neighbours, ctx.tensor("neighbours"), 0, n_anchors - 1, "anchor indices")
    ranks = _tensor(tensors, ctx, "ranks", INT_DTYPES, (n_coded,))
    _check_values(ranks, ctx.tensor("ranks"), 0, rank, "ranks (R = min(config rank, basis rank, D))")
    total = int(ranks.long().sum())
    if "quantized" not in row:
        _tensor(tensors, ctx, "coefs", (dtype,), (total,))
        return
    q = row["quantized"]
    expect(isinstance(q, dict), ctx.field("quantized"), q, "an object with bits, group and count")
    bits = _int(q, "bits", ctx.sub("quantized"))
    expect(bits in BITS, ctx.field("quantized.bits"), bits, f"one of {list(BITS)}")
    group = _int(q, "group", ctx.sub("quantized"), low=1)
    _int(q, "count", ctx.sub("quantized"), low=total, high=total)
    _tensor(tensors, ctx, "codes", (torch.uint8,), (packed_bytes(total, bits),))
    axis = q.get("axis", "token")
    expect(axis in AXES, ctx.field("quantized.axis"), axis, f"one of {list(AXES)} (or absent: 'token')")
    groups = scale_count(ranks, group, axis)
    mins = _tensor(tensors, ctx, "mins", (torch.float16, torch.float32), (groups,))
    _tensor(tensors, ctx, "steps", (mins.dtype,), (groups,))


def _check_span(row: dict, tensors: dict, ctx: _Where, seq_len: int, prompt_len: int) -> int:
    """The row's real tokens: (start, stop) slots, or null and the slots themselves. Returns the first slot."""
    span = row.get("span", False)
    if span is not None:
        ok = isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
        ok = ok and 0 <= span[0] and span[1] - span[0] == seq_len and span[1] <= prompt_len
        expect(ok, ctx.field("span"), span, f"null or [start, start + {seq_len}] within the prompt's "
                f"{prompt_len} slots")
        return span[0]
    slots = _tensor(tensors, ctx, "slots", (torch.int64,), (seq_len,))
    _check_values(slots, ctx.tensor("slots"), 0, prompt_len - 1, "cache slots")
    expect(bool((slots[1:] > slots[:-1]).all()), ctx.tensor("slots"), _Text("not increasing"), "increasing slots")
    return int(slots[0]) if seq_len else 0


def _check_kv(cache, tensors: dict, ctx: _Where, key_name: str, value_name: str, *, dtype=None, batch=None,
              tokens=None) -> torch.Tensor:
    """keys and values [B, H, n, d] of the model's H and d, in one float dtype; returns the keys."""
    shape = (batch, cache.model_shape.num_kv_heads, tokens, cache.model_shape.head_dim)
    dtypes = (dtype,) if dtype is not None else tuple(FLOAT_DTYPES.values())
    keys = _tensor(tensors, ctx, key_name, dtypes, shape)
    _tensor(tensors, ctx, value_name, (keys.dtype,), keys.shape)
    return keys


def _tensor(tensors: dict, ctx: _Where, name: str, dtypes, shape) -> torch.Tensor:
    """tensors[name], if its dtype is one of `dtypes` and its shape `shape` (None: any size)."""
    tensor = tensors.get(ctx.prefix + "." + name)
    expected = f"a {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} tensor of shape " \
               f"[{', '.join('*' if n is None else str(n) for n in shape)}]"
    ok = tensor is not None and tensor.dtype in dtypes and tensor.dim() == len(shape)
    ok = ok and all(n is None or n == m for n, m in zip(shape, tensor.shape))
    expect(ok, ctx.tensor(name), _Text("missing") if tensor is None else _describe(tensor), expected)
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        # the prefill refuses NaN/inf, and a finite code decodes finite: such a file was edited or badly written
        expect(False, ctx.tensor(name), _Text(f"{_describe(tensor)} holding NaN or inf"), "finite values")
    return tensor


def _check_values(tensor: torch.Tensor, where: str, low: int, high: int, what: str) -> None:
    if tensor.numel():
        lo, hi = int(tensor.min()), int(tensor.max())
        expect(low <= lo and hi <= high, where, _Text(f"values in [{lo}, {hi}]"), f"{what} in [{low}, {high}]")


def _int(info: dict, name: str, ctx: _Where, low: int = 0, high: int = MAX_INT) -> int:
    value = info.get(name)
    expected = f"{low}" if low == high else f"an integer in [{low}, {high}]"
    expect(type(value) is int and low <= value <= high, ctx.field(name), value, expected)
    return value


def _exact_count(seq_len: int, stride: int, window: int) -> int:
    """|E| of `exact_mask(seq_len, stride, window)`, in closed form (nothing allocated before it is checked)."""
    return -(-max(seq_len - window, 0) // stride) + min(window, seq_len)


def expect(ok: bool, where: str, found, expected: str) -> None:
    if not ok:
        shown = found if isinstance(found, _Text) else repr(found)
        raise CacheFileError(f"{where} is {shown[:120]}, expected {expected}; {NOT_CONSISTENT}")


class _Recording(dict):
    """The file's tensors, remembering which names the checks asked for (the rest belong to no layer)."""

    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.read: set[str] = set()

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)


class _Text(str):
    """A description to show as is in an error (a tensor's dtype and shape), not a JSON value to repr."""


def _describe(tensor: torch.Tensor) -> _Text:
    return _Text(f"{str(tensor.dtype).removeprefix('torch.')} [{', '.join(map(str, tensor.shape))}]")


def _show(found) -> str:
    return "nothing (empty)" if found is None else f"({found[0]}, {found[1]}, {str(found[2]).removeprefix('torch.')})"


@dataclass(frozen=True)
class _Where:
    """Names a saved cache's fields (`cache_config.json: layers[0].rows[1].seq_len`) and tensors."""

    folder: Path
    json: str
    prefix: str

    def node(self) -> str:
        return f"{self.folder / CONFIG_NAME}: {self.json}"

    def field(self, name: str) -> str:
        return f"{self.node()}.{name}"

    def tensor(self, name: str) -> str:
        return f"{self.folder / TENSORS_NAME}: tensor {self.prefix}.{name}"

    def row(self, b: int) -> _Where:
        return _Where(self.folder, f"{self.json}.rows[{b}]", f"{self.prefix}.rows.{b}")

    def sub(self, name: str) -> _Where:
        return _Where(self.folder, f"{self.json}.{name}", self.prefix)
