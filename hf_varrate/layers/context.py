"""`PrefillContext`: what a layer needs to code its prompt that only the attention module sees.

The binding hook hands one over at each multi-token forward; a prompt that arrives in several forwards
(a chunked prefill) is held until it is complete, its contexts merged as if it had come in one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class PrefillContext:
    """queries [B, Hq, W, d] post-RoPE (the prompt's last W); cos, sin [B or 1, S, d]; key_valid [B, S] bool
    or None (no padding)."""

    queries: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scaling: float
    key_valid: torch.Tensor | None


def merge_contexts(first: PrefillContext, then: PrefillContext, window: int) -> PrefillContext:
    """The context of a prompt that arrived as `first`, then `then`: tables and padding concatenated along
    the tokens, the last `window` queries of both."""
    queries = torch.cat([first.queries, then.queries.to(first.queries.device)], dim=2)[:, :, -window:]
    cos, sin = _cat_rows(first.cos, then.cos), _cat_rows(first.sin, then.sin)
    valid = None
    if first.key_valid is not None or then.key_valid is not None:
        valid = torch.cat([_valid(first, cos.shape[0]), _valid(then, cos.shape[0])], dim=1)
    return PrefillContext(queries, cos, sin, then.scaling, valid)


def crop_context(context: PrefillContext, length: int) -> PrefillContext:
    """The context of the first `length` tokens (the queries stay: they only weigh salience)."""
    valid = None if context.key_valid is None else context.key_valid[:, :length]
    return replace(context, cos=context.cos[:, :length], sin=context.sin[:, :length], key_valid=valid)


def select_context(context: PrefillContext, rows: list[int]) -> PrefillContext:
    """The context of the batch rows `rows` (beam search, batch selection)."""
    pick = torch.tensor(rows, dtype=torch.long)

    def rows_of(t):
        return t if t is None or t.shape[0] == 1 else t.index_select(0, pick.to(t.device))

    return replace(context, queries=rows_of(context.queries), cos=rows_of(context.cos), sin=rows_of(context.sin),
                   key_valid=rows_of(context.key_valid))


def _cat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B or 1, S1, d] and [B or 1, S2, d] concatenated along the tokens (a shared row broadcast)."""
    rows = max(a.shape[0], b.shape[0])
    return torch.cat([a.expand(rows, -1, -1), b.to(a.device).expand(rows, -1, -1)], dim=1)


def _valid(context: PrefillContext, rows: int) -> torch.Tensor:
    if context.key_valid is not None:
        return context.key_valid.expand(rows, -1)
    return torch.ones(rows, context.cos.shape[1], dtype=torch.bool, device=context.cos.device)
