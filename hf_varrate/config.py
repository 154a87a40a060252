"""`VarRateConfig`: every knob of the codec and its default, written once, and the named presets.

Defaults are the paper's (Section 4.1): budget 0.20, r_min 16, R = 1024 capped at D, stride 16,
c = 4 nearest anchors, window = obs_window = 64, SnapKV pooling kernel 5. Each field's metadata
names its group: "paper" (the method), "beyond" (options beyond the paper, all off by default),
"runtime" (how the cache is held and computed; no effect on what is coded) and "developer"
(knobs for tests and evaluation, left out of `repr` and of `VarRateConfig.user_fields()`).
The salience signals are those registered in `hf_varrate.signals`.

A config is checked once, when it is built, and is immutable afterwards (assigning a field raises;
`config.replace(field=value)` builds a checked copy). Numbers may be numpy or other numeric scalars:
they are stored as Python ints and floats. A misspelt keyword is a `TypeError` naming the closest field.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any

from .signals import SIGNALS

GROUPS = ("paper", "beyond", "runtime", "developer")
ALLOCATIONS = ("waterfill", "topk")
STORAGES = ("materialized", "compact")
IMPLEMENTATIONS = ("fast", "reference")
COEF_BITS = (None, 3, 4, 8)
QUANTIZED_BUDGETS = ("same_ranks", "same_bytes")
BALANCES = ("none", "rms")
BUDGET_DTYPES = (None, "float16", "bfloat16", "float32")
LAYER_BUDGETS = ("uniform", "spectrum")
PROJECTION_DTYPES = ("float32", "bfloat16", "auto")
PRESETS = ("paper", "recommended")
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes


@dataclass
class VarRateConfig:
    """Configuration of the VarRate codec (one config for every layer of a model)."""

    budget: float = field(
        default=0.20,
        metadata={"group": "paper", "help": "Fraction of the full K/V bytes kept for the prompt, in (0, 1] (paper's kappa)."},
    )
    r_min: int = field(default=16, metadata={"group": "paper", "help": "Rank floor of every coded token (Eq. 5)."})
    rank: int | None = field(
        default=1024,
        metadata={"group": "paper", "help": "Basis rank R; capped at the joint width D and at the loaded basis's rank."},
    )
    stride: int = field(default=16, metadata={"group": "paper", "help": "Anchor stride Delta: tokens 0, stride, 2*stride... are exact."})
    n_anchors: int = field(default=4, metadata={"group": "paper", "help": "c, the number of nearest anchors a residual is taken to (Eq. 2)."})
    window: int = field(default=64, metadata={"group": "paper", "help": "The last `window` prompt tokens are stored exactly."})
    obs_window: int = field(default=64, metadata={"group": "paper", "help": "Number of last prompt queries that score salience (Eq. 4)."})
    pool_kernel: int = field(default=5, metadata={"group": "paper", "help": "SnapKV moving-average length over adjacent tokens (odd)."})
    signal: str = field(
        default="snapkv",
        metadata={"group": "paper",
            "help": "Salience signal: 'snapkv' (paper), 'uniform' (flat ablation), 'random', 'shuffle' "
            "(SnapKV scores permuted), 'position' (sink + recency shape, no content); beyond the paper, "
            "query-agnostic: 'key_norm' (mean key norm over heads) or 'residual' (norm of the token's residual to "
            "its anchors: rank follows how hard the token is to code). Any signal registered in "
            "hf_varrate.signals."
        },
    )
    allocation: str = field(
        default="waterfill",
        metadata={"group": "paper", "help": "'waterfill' (Eq. 5) or 'topk' (binary split: winners at R, the rest at r_min)."},
    )
    storage: str = field(
        default="materialized",
        metadata={"group": "runtime",
            "help": "'materialized' (reconstruct the prompt once at the prefill and hold full-length K/V, as the "
            "paper does: fastest decoding) or 'compact' (hold only the codes and exact tokens: the cache really "
            "takes the footprint fraction of memory; each read rebuilds a layer's K/V, or, under the model's "
            "'varrate' attention implementation, attends over the codes, about twice as fast)."
        },
    )
    coef_bits: int | None = field(
        default=None,
        metadata={"group": "paper", "help": "Quantize coefficients to 3, 4 or 8 bits, group-wise (Section 3.3, App. A.4); None keeps "
                  "them in the model's dtype."},
    )
    coef_group: int = field(
        default=32, metadata={"group": "paper", "help": "Coefficients per quantization group (each group stores an fp16 min and step)."}
    )
    quantized_budget: str = field(
        default="same_ranks",
        metadata={"group": "paper",
            "help": "With coef_bits: 'same_ranks' allocates ranks as for unquantized coefficients and stores fewer "
            "bytes (paper, App. A.4); 'same_bytes' holds the byte budget and spends the saving on rank."
        },
    )
    # developer knobs: tests and evaluation set them, users need not (left out of repr and user_fields)
    implementation: str = field(
        default="fast", repr=False,
        metadata={"group": "developer", "help": "'fast' (rank-blocked matmuls, row gathers) or 'reference' (the "
                  "plain path it is tested against)."},
    )
    distance_chunk: int = field(
        default=1024, repr=False,
        metadata={"group": "developer", "help": "Coded tokens per chunk of the fp32 anchor-distance computation."},
    )
    seed: int = field(default=0, repr=False,
                      metadata={"group": "developer", "help": "Seed of the 'random' and 'shuffle' signals."})
    budget_dtype: str | None = field(
        default=None, repr=False,
        metadata={"group": "developer", "help": "Count the budget as if K/V were in this dtype ('float16', "
                  "'bfloat16', 'float32'); None: the cache's own dtype. 'float16' sizes a cache computed in fp32 (e.g. on CPU) exactly as an fp16 "
                  "deployment would be sized: same ranks, so quantized coefficients are not flattered. Never wider than "
                  "the K/V's dtype (the cache would exceed its budget)."},
    )
    projection_dtype: str = field(
        default="float32",
        metadata={"group": "runtime", "help": "dtype of the projection matmuls (encode c = V e, decode V^T c): 'float32' (the paper); "
                  "'bfloat16' (fp32 accumulation and fp32 anchor means: the coefficients and the decoded "
                  "correction carry bf16 rounding, ~0.4%; 3-5x faster matmuls on GPUs and on CPUs with AMX or "
                  "AVX-512 BF16, slower elsewhere); 'auto': bfloat16 where the device multiplies it natively, else "
                  "float32. Distances and salience are always fp32."},
    )
    # beyond the paper; every one is off in the paper's defaults
    balance: str = field(
        default="none",
        metadata={"group": "beyond", "help": "'rms' scales the value half of z_t so that keys and values carry equal calibration "
                  "residual energy before anchor search and PCA (undone after decoding; needs bases with a "
                  "spectrum); 'none' codes z_t as the paper does (keys dominate its norm)."},
    )
    key_weight: float = field(
        default=1.0,
        metadata={"group": "beyond", "help": "Weight of the keys against the values in z_t (after balance): the value "
                  "half is divided by it before anchor search and PCA (undone after decoding; needs bases with a "
                  "spectrum unless 1), so a weight above 1 moves error, and bytes, from keys to values. 1 codes "
                  "z_t as balance leaves it."},
    )
    flat_floor: float = field(
        default=0.0,
        metadata={"group": "beyond", "help": "Rank floor as a share of the flat rank B / C: every coded token gets at least "
                  "max(r_min, flat_floor * B / C), so a stale salience signal cannot starve a token. In [0, 1]; "
                  "1 is flat allocation."},
    )
    anchor_share: float | None = field(
        default=None,
        metadata={"group": "beyond", "help": "Budget-aware stride: the exact set (anchors + window) may take at most this share of "
                  "the budget; the stride doubles until it does (at most until n_anchors anchors remain). None "
                  "keeps the stride, and a budget too small for the exact set stores the prompt exactly."},
    )
    layer_budgets: str = field(
        default="uniform",
        metadata={"group": "beyond", "help": "'uniform': every layer gets the budget (the paper); 'spectrum': the layers share their "
                  "coefficient bytes by their calibration spectra, each keeping the directions above one common "
                  "share of its residual energy (at least half the flat rank), so that rank goes where it removes "
                  "the most relative error (needs bases with a spectrum)."},
    )

    def __new__(cls, *args, **kwargs):
        cls.check_keys(kwargs)  # before the dataclass __init__'s bare "unexpected keyword argument"
        return super().__new__(cls)

    def __setattr__(self, name, value):
        if self.__dict__.get("_checked"):
            raise dataclasses.FrozenInstanceError(
                f"a VarRateConfig is immutable once checked; use config.replace({name}={value!r}), which returns a "
                f"checked copy")
        object.__setattr__(self, name, value)

    def __post_init__(self):
        _to_python_numbers(self)
        self._check()
        object.__setattr__(self, "_checked", True)

    def _check(self):
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
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or \
                not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be an integer that torch.manual_seed takes (-2**63 to 2**64 - 1), got "
                             f"{self.seed!r}; use e.g. seed=0 (the default)")
        _check_choice("signal", self.signal, tuple(SIGNALS))
        _check_choice("allocation", self.allocation, ALLOCATIONS)
        _check_choice("storage", self.storage, STORAGES)
        if self.coef_bits is not None:
            _check_int("coef_bits", self.coef_bits, 1)
        _check_choice("coef_bits", self.coef_bits, COEF_BITS)
        _check_int("coef_group", self.coef_group, 1)
        _check_choice("quantized_budget", self.quantized_budget, QUANTIZED_BUDGETS)
        _check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        _check_choice("budget_dtype", self.budget_dtype, BUDGET_DTYPES)
        _check_choice("balance", self.balance, BALANCES)
        _check_choice("layer_budgets", self.layer_budgets, LAYER_BUDGETS)
        _check_choice("projection_dtype", self.projection_dtype, PROJECTION_DTYPES)
        _check_range("key_weight", self.key_weight, 0.0, 1e6, low_open=True, fix="use e.g. key_weight=4.0 (or 1.0: off)")
        _check_range("flat_floor", self.flat_floor, 0.0, 1.0, fix="use e.g. flat_floor=0.5 (half the flat rank)")
        if self.anchor_share is not None:
            _check_range("anchor_share", self.anchor_share, 0.0, 1.0, low_open=True,
                         fix="use e.g. anchor_share=0.25, or None to keep the stride")
        beyond = {"balance": self.balance != "none", "key_weight": self.key_weight != 1.0,
                  "signal": not SIGNALS[self.signal].paper,
                  "layer_budgets": self.layer_budgets != "uniform",
                  "projection_dtype": self.projection_dtype != "float32"}
        if self.implementation == "reference" and any(beyond.values()):
            name = next(k for k, v in beyond.items() if v)
            raise ValueError(f"implementation='reference' runs the paper's algorithm only, got {name}="
                             f"{getattr(self, name)!r}; use implementation='fast' (the default)")

    @classmethod
    def preset(cls, name: str, **overrides) -> VarRateConfig:
        """A named set of defaults: 'paper' (Section 4.1, for reproduction: every option beyond the paper off)
        or 'recommended' (options beyond the paper chosen on a development split; see docs/): 4-bit
        coefficients at the same bytes, anchors held to a quarter of the budget, key/value balance,
        uniform ranks (under reuse no salience signal we tried beat them), and bf16 projection matmuls where
        the device multiplies bf16 natively."""
        _check_choice("preset", name, PRESETS)
        base = {} if name == "paper" else dict(RECOMMENDED_PRESET)
        return cls(**{**base, **overrides})

    @classmethod
    def coerce(cls, config) -> VarRateConfig:
        """`config` as a VarRateConfig: None gives the defaults, a dict goes through `from_dict`."""
        if config is None:
            return cls()
        if isinstance(config, dict):
            return cls.from_dict(config)
        if not isinstance(config, cls):
            raise TypeError(f"config must be a VarRateConfig, a dict of its fields or None, got "
                            f"{type(config).__name__}; e.g. VarRateConfig.preset('recommended', budget=0.2)")
        return config

    @classmethod
    def check_keys(cls, names) -> None:
        """TypeError for a name that is no field, suggesting the closest one."""
        known = [f.name for f in dataclasses.fields(cls)]
        for name in names:
            if name not in known:
                raise TypeError(f"VarRateConfig has no field {name!r}{_suggestion(name, known)}; its fields are "
                                f"{known}")

    @classmethod
    def runtime_fields(cls) -> list[str]:
        """The fields that change how a cache is held or computed, never what was coded: the only ones a saved
        cache may be loaded with (`VarRateCache.load(dir, model=m, storage='compact')`)."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("group") == "runtime"]

    @classmethod
    def user_fields(cls) -> list[str]:
        """The fields a user sets (every group but "developer"), in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("group") != "developer"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides) -> VarRateConfig:
        """Build a config from a dict; unknown keys are ignored with a warning naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        merged = {**data, **overrides}
        unknown = sorted(set(merged) - known)
        if unknown:
            hints = "".join(_suggestion(name, known) for name in unknown)
            warnings.warn(
                f"VarRateConfig ignores unknown keys {unknown}; they may come from a newer hf_varrate "
                f"(pip install -U hf_varrate) or be misspelt{hints} (known keys: {sorted(known)})",
                stacklevel=2,
            )
        return cls(**{k: v for k, v in merged.items() if k in known})

    def replace(self, **changes) -> VarRateConfig:
        """A checked copy with `changes` applied."""
        self.check_keys(changes)
        return dataclasses.replace(self, **changes)


# Chosen on the development split of the beyond-the-paper ablation (evaluation/configs/beyond_dev.yaml:
# SmolLM2 needles at 2K, 24 examples, budget 0.2, query-agnostic): the highest pooled score, 21/24 (full
# cache: 20/24; the paper's defaults: 0/24). Confirmed on a held-out split (docs/). projection_dtype 'auto'
# joined later: bf16 matmuls where the device has them natively; the held-out reconstruction error is the
# same to three decimals (docs/results/benchmarks/presets_smollm2-135m-instruct.md).
RECOMMENDED_PRESET = {"coef_bits": 4, "quantized_budget": "same_bytes", "anchor_share": 0.25, "balance": "rms",
                      "signal": "uniform", "projection_dtype": "auto"}


def _to_python_numbers(config: VarRateConfig) -> None:
    """numpy (or other numeric) scalars become Python ints and floats, the only numbers the checks and
    `to_dict`'s JSON take; an integral value in a float field stays as it is."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if type(value) in (bool, int, float) or not isinstance(value, numbers.Number):  # np.float64 is a float
            continue
        kind = str(f.type)
        if isinstance(value, numbers.Integral) and "int" in kind:
            object.__setattr__(config, f.name, int(value))
        elif isinstance(value, numbers.Real) and "float" in kind:
            object.__setattr__(config, f.name, _shortest_float(value))


def _shortest_float(value) -> float:
    """np.float32(0.4) -> 0.4 (the number the user wrote), not 0.4000000059604645."""
    try:
        return float(str(value))
    except ValueError:
        return float(value)


def _suggestion(name, known) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
