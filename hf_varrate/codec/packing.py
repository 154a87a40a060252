"""What one sequence's compressed prompt holds, and how many bytes that is.

Shapes: S valid prompt tokens, E exact, C coded, c anchors per coded token, H kv heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .anchors import anchor_positions, coded_positions, exact_positions
from .codes import QuantizedCoefs, packed_bytes


@dataclass
class PromptCode:
    """One sequence's prompt after compression (one layer).

    The exact / coded / anchor positions follow from (seq_len, stride, window) and are computed on
    access, never held. `neighbours`, `ranks` and `coefs` are the codes (`coefs` is the packed
    coefficient stream [sum(ranks)] in the model's dtype, or a `QuantizedCoefs`); `exact_keys` /
    `exact_values` [1, H, E, d] are only held here in compact storage (materialized storage keeps
    them inside the full-length tensors).
    """

    seq_len: int
    stride: int
    window: int
    neighbours: torch.Tensor  # [C, c] small int, indices into the anchors
    ranks: torch.Tensor  # [C] small int
    coefs: torch.Tensor | QuantizedCoefs  # [sum(ranks)]
    width: int  # D
    kv_bytes: int  # bytes per element of the model's K/V
    stored_exactly: bool = False
    exact_keys: torch.Tensor | None = field(default=None, repr=False)  # [1, H, E, d]
    exact_values: torch.Tensor | None = field(default=None, repr=False)  # [1, H, E, d]
    # the outcome of choosing the coefficients' layout (`pipeline.code_layout`: a `projection.LayoutShape`,
    # python numbers only), kept once chosen: choosing reads the ranks back to the host, which a decoding step
    # must not do on a GPU
    layout: object = field(default=None, repr=False, compare=False)

    # positions (derived) -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.exact_keys.device if self.exact_keys is not None else self.ranks.device

    @property
    def exact_pos(self) -> torch.Tensor:
        """[E] long: positions stored exactly (anchors + window; every token when stored_exactly)."""
        if self.stored_exactly:
            return torch.arange(self.seq_len, device=self.device)
        return exact_positions(self.seq_len, self.stride, self.window, self.device)

    @property
    def coded_pos(self) -> torch.Tensor:
        """[C] long: positions coded at a rank, in increasing order (the order of `ranks`)."""
        if self.stored_exactly:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        return coded_positions(self.seq_len, self.stride, self.window, self.device)

    @property
    def anchor_pos(self) -> torch.Tensor:
        """[A] long: the anchors, a subset of the exact positions; `neighbours` index into them."""
        return anchor_positions(self.seq_len, self.stride, self.device)

    # bytes ---------------------------------------------------------------------------------------
    def nbytes(self, limit: int | None = None, kv_bytes: int | None = None) -> int:
        """Bytes this prompt costs: exact tokens at full width plus every coded token's codes.

        Without `limit` this is exactly the bytes of the tensors the code holds (counting the exact
        tokens at full width even where materialized storage keeps them elsewhere). `limit` counts
        only the first `limit` tokens (after a crop of a materialized cache into the prompt).
        `kv_bytes` counts exact tokens and unquantized coefficients at that many bytes a value instead
        of the held dtype's: what the same code takes in another K/V dtype (e.g. 2 for fp16 when the
        cache ran in fp32 on CPU); quantized coefficients, anchor indices and ranks stay as stored.
        """
        return sum(self.byte_parts(limit, kv_bytes).values())

    def byte_parts(self, limit: int | None = None, kv_bytes: int | None = None) -> dict[str, int]:
        """`nbytes` by what the bytes hold: the `exact` tokens, the coefficients' `codes`, their quantization
        `scales` (0 unquantized), the coded tokens' `anchor_indices` and their `ranks`."""
        limit = self.seq_len if limit is None else max(min(limit, self.seq_len), 0)
        value_bytes = self.kv_bytes if kv_bytes is None else kv_bytes
        parts = {"exact": int((self.exact_pos < limit).sum()) * self.width * value_bytes, "codes": 0, "scales": 0,
                 "anchor_indices": 0, "ranks": 0}
        if self.stored_exactly:
            return parts
        ranks = self.ranks if limit == self.seq_len else self.ranks[self.coded_pos < limit]
        parts["anchor_indices"] = ranks.numel() * self.neighbours.shape[1] * self.neighbours.element_size()
        parts["ranks"] = ranks.numel() * self.ranks.element_size()
        if isinstance(self.coefs, QuantizedCoefs):
            whole = limit == self.seq_len  # the tensors held, else what a stream for the kept ranks takes
            parts["codes"] = (self.coefs.codes.numel() if whole
                              else packed_bytes(int(ranks.long().sum()), self.coefs.bits))
            parts["scales"] = (coef_bytes(self.coefs) if whole else self.coefs.nbytes_for(ranks)) - parts["codes"]
        else:
            parts["codes"] = int(ranks.long().sum()) * (self.coefs.element_size() if kv_bytes is None else kv_bytes)
        return parts

    def full_nbytes(self, kv_bytes: int | None = None) -> int:
        """Bytes the same prompt takes uncompressed in the same dtype (or at `kv_bytes` a value)."""
        return self.seq_len * self.width * (self.kv_bytes if kv_bytes is None else kv_bytes)

    # saved caches ----------------------------------------------------------------------------------
    def to_tensors(self, exact_keys: torch.Tensor, exact_values: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON-able fields, named tensors) of this code with its exact tokens [1, H, E, d]; the one place
        the saved-cache format of a code is written (`from_tensors` reads it)."""
        row = {"seq_len": self.seq_len, "stride": self.stride, "window": self.window, "width": self.width,
               "kv_bytes": self.kv_bytes, "stored_exactly": self.stored_exactly}
        tensors = {"exact_keys": exact_keys, "exact_values": exact_values}
        if self.stored_exactly:
            return row, tensors
        tensors["neighbours"], tensors["ranks"] = self.neighbours, self.ranks
        if isinstance(self.coefs, QuantizedCoefs):
            q = self.coefs
            tensors["codes"], tensors["mins"], tensors["steps"] = q.codes, q.mins, q.steps
            row["quantized"] = {"bits": q.bits, "group": q.group, "count": q.count}
            if q.axis != "token":
                row["quantized"]["axis"] = q.axis
        else:
            tensors["coefs"] = self.coefs
        return row, tensors

    @classmethod
    def from_tensors(cls, row: dict, tensors: dict[str, torch.Tensor], device) -> PromptCode:
        """The code `to_tensors` wrote (fields checked beforehand), holding its exact tokens, on `device`."""
        get = lambda name: tensors[name].to(device)  # noqa: E731
        exact_k, exact_v = get("exact_keys"), get("exact_values")
        empty = torch.empty(0, dtype=torch.int16, device=device)
        code = cls(row["seq_len"], row["stride"], row["window"], empty.view(0, 1), empty, empty.to(exact_k.dtype),
                   row["width"], row["kv_bytes"], row["stored_exactly"], exact_k, exact_v)
        if not code.stored_exactly:
            code.neighbours, code.ranks = get("neighbours"), get("ranks")
            if "quantized" in row:
                q = row["quantized"]
                code.coefs = QuantizedCoefs(get("codes"), get("mins"), get("steps"), q["bits"], q["group"], q["count"],
                                            q.get("axis", "token"))
            else:
                code.coefs = get("coefs")
        return code

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this code holds (for memory accounting)."""
        held = [self.neighbours, self.ranks]
        held += self.coefs.tensors() if isinstance(self.coefs, QuantizedCoefs) else [self.coefs]
        held += [t for t in (self.exact_keys, self.exact_values) if t is not None]
        return held


def coef_bytes(coefs) -> int:
    if isinstance(coefs, QuantizedCoefs):
        return coefs.nbytes()
    return tensor_bytes(coefs)


def tensor_bytes(*tensors) -> int:
    """Bytes of the given tensors' elements (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def smallest_uint(max_value: int) -> torch.dtype:
    """The narrowest integer dtype that holds 0..max_value (torch has no uint16 arithmetic, so int16)."""
    if max_value < 256:
        return torch.uint8
    if max_value < 2**15:
        return torch.int16
    return torch.int32


def meta_bytes_per_token(n_anchors: int, num_anchors: int, rank: int) -> int:
    """Bytes of side information per coded token: its anchor indices and its rank."""
    index_bytes = torch.empty(0, dtype=smallest_uint(num_anchors - 1)).element_size()
    rank_bytes = torch.empty(0, dtype=smallest_uint(rank)).element_size()
    return n_anchors * index_bytes + rank_bytes
