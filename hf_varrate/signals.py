"""The registry of salience signals: the names `VarRateConfig.signal` accepts and what each one needs.

A signal is one function `fn(inputs: SignalInputs) -> s_hat [C]` in [0, 1] over the coded tokens,
registered with `@register_signal(name, ...)`; the codec's own signals register themselves in
`hf_varrate.codec.salience` (imported with the package). The registry sits below both the config
(which validates names against it) and the codec (which calls the functions), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class SignalInputs:
    """What a signal may read. `residuals` [C, D] (each coded token's z_t minus its anchors' mean) exist
    only for signals registered with `after_anchors=True`, which are scored after the anchor search."""

    queries: torch.Tensor
    keys: torch.Tensor
    scaling: float
    coded: torch.Tensor
    seq_len: int
    stride: int
    window: int
    pool_kernel: int
    seed: int
    residuals: torch.Tensor | None = None


@dataclass(frozen=True)
class Signal:
    """A registered signal: its function and what it needs. `query_aware`: it reads the prefill's window
    queries (so the cache needs the model bound); `paper`: one of the paper's signals or controls
    (`implementation='reference'` runs only those)."""

    score: Callable[[SignalInputs], torch.Tensor]
    query_aware: bool = False
    after_anchors: bool = False
    paper: bool = False


SIGNALS: dict[str, Signal] = {}


def register_signal(name: str, *, query_aware: bool = False, after_anchors: bool = False, paper: bool = False):
    """Decorator: register `fn(inputs: SignalInputs) -> s_hat [C] in [0, 1]` as signal `name`."""
    def register(fn):
        SIGNALS[name] = Signal(fn, query_aware, after_anchors, paper)
        return fn
    return register


def coded_salience(signal: str, inputs: SignalInputs) -> torch.Tensor:
    """[C] normalised salience s-hat over the coded tokens for the named signal (empty when nothing is coded)."""
    if inputs.coded.numel() == 0:
        return torch.zeros(0, device=inputs.coded.device)
    return SIGNALS[signal].score(inputs)
