"""`VarRateConfig`: every knob of the codec and its default, written once.

Defaults are the paper's (Section 4.1): budget 0.20, r_min 16, R = 1024 capped at D, stride 16,
c = 4 nearest anchors, window = obs_window = 64, SnapKV pooling kernel 5.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

SIGNALS = ("snapkv", "uniform", "random", "shuffle", "position")
ALLOCATIONS = ("waterfill", "topk")
STORAGES = ("materialized", "compact")
IMPLEMENTATIONS = ("fast", "reference")
COEF_BITS = (None, 3, 4, 8)
QUANTIZED_BUDGETS = ("same_ranks", "same_bytes")


@dataclass
class VarRateConfig:
    """Configuration of the VarRate codec (one config for every layer of a model)."""

    budget: float = field(
        default=0.20,
        metadata={"help": "Fraction of the full K/V bytes kept for the prompt, in (0, 1] (paper's kappa)."},
    )
    r_min: int = field(default=16, metadata={"help": "Rank floor of every coded token (Eq. 5)."})
    rank: int | None = field(
        default=1024,
        metadata={"help": "Basis rank R; capped at the joint width D and at the loaded basis's rank."},
    )
    stride: int = field(default=16, metadata={"help": "Anchor stride Delta: tokens 0, stride, 2*stride... are exact."})
    n_anchors: int = field(default=4, metadata={"help": "c, the number of nearest anchors a residual is taken to (Eq. 2)."})
    window: int = field(default=64, metadata={"help": "The last `window` prompt tokens are stored exactly."})
    obs_window: int = field(default=64, metadata={"help": "Number of last prompt queries that score salience (Eq. 4)."})
    pool_kernel: int = field(default=5, metadata={"help": "SnapKV moving-average length over adjacent tokens (odd)."})
    signal: str = field(
        default="snapkv",
        metadata={
            "help": "Salience signal: 'snapkv' (paper), 'uniform' (flat ablation), 'random', 'shuffle' "
            "(SnapKV scores permuted) or 'position' (sink + recency shape, no content)."
        },
    )
    allocation: str = field(
        default="waterfill",
        metadata={"help": "'waterfill' (Eq. 5) or 'topk' (binary split: winners at R, the rest at r_min)."},
    )
    storage: str = field(
        default="materialized",
        metadata={
            "help": "'materialized' (reconstruct the prompt once at the prefill and hold full-length K/V, as the "
            "paper does: fastest decoding) or 'compact' (hold only the codes and exact tokens, reconstruct a "
            "layer's K/V at each read: the cache really takes the footprint fraction of memory)."
        },
    )
    coef_bits: int | None = field(
        default=None,
        metadata={"help": "Quantize coefficients to 3, 4 or 8 bits, group-wise (Section 3.3, App. A.4); None keeps "
                  "them in the model's dtype."},
    )
    coef_group: int = field(
        default=32, metadata={"help": "Coefficients per quantization group (each group stores an fp16 min and step)."}
    )
    quantized_budget: str = field(
        default="same_ranks",
        metadata={
            "help": "With coef_bits: 'same_ranks' allocates ranks as for unquantized coefficients and stores fewer "
            "bytes (paper, App. A.4); 'same_bytes' holds the byte budget and spends the saving on rank."
        },
    )
    implementation: str = field(
        default="fast",
        metadata={"help": "'fast' (rank-blocked matmuls, row gathers) or 'reference' (the plain path it is tested "
                  "against)."},
    )
    distance_chunk: int = field(
        default=1024, metadata={"help": "Coded tokens per chunk of the fp32 anchor-distance computation."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the 'random' and 'shuffle' signals."})

    def __post_init__(self):
        _check_range("budget", self.budget, 0.0, 1.0, low_open=True, fix="use e.g. budget=0.2 (keep 20%)")
        _check_int("r_min", self.r_min, 0)
        if self.rank is not None:
            _check_int("rank", self.rank, 1)
            if self.r_min > self.rank:
                raise ValueError(
                    f"r_min must be <= rank, got r_min={self.r_min} and rank={self.rank}; "
                    f"lower r_min or raise rank"
                )
        _check_int("stride", self.stride, 1)
        _check_int("n_anchors", self.n_anchors, 1)
        _check_int("window", self.window, 1)
        _check_int("obs_window", self.obs_window, 1)
        _check_int("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be odd, got {self.pool_kernel}; use e.g. 5")
        _check_int("distance_chunk", self.distance_chunk, 1)
        _check_choice("signal", self.signal, SIGNALS)
        _check_choice("allocation", self.allocation, ALLOCATIONS)
        _check_choice("storage", self.storage, STORAGES)
        if self.coef_bits is not None:
            _check_int("coef_bits", self.coef_bits, 1)
        _check_choice("coef_bits", self.coef_bits, COEF_BITS)
        _check_int("coef_group", self.coef_group, 1)
        _check_choice("quantized_budget", self.quantized_budget, QUANTIZED_BUDGETS)
        _check_choice("implementation", self.implementation, IMPLEMENTATIONS)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides) -> VarRateConfig:
        """Build a config from a dict; unknown keys are ignored with a warning naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        merged = {**data, **overrides}
        unknown = sorted(set(merged) - known)
        if unknown:
            warnings.warn(
                f"VarRateConfig ignores unknown keys {unknown}; they may come from a newer hf_varrate "
                f"(pip install -U hf_varrate) or be misspelt (known keys: {sorted(known)})",
                stacklevel=2,
            )
        return cls(**{k: v for k, v in merged.items() if k in known})

    def replace(self, **changes) -> VarRateConfig:
        return dataclasses.replace(self, **changes)


def _check_range(name, value, low, high, *, low_open=False, fix=""):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}; {fix}")


def _check_int(name, value, minimum):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        default = VarRateConfig.__dataclass_fields__[name].default
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}; use e.g. {name}={default} "
                         f"(the default)")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
