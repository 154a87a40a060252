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
import warnings
from dataclasses import dataclass, field
from typing import Any

from .config_checks import (  # noqa: F401 (re-exported: the allowed values live with their checks)
    ALLOCATIONS,
    BALANCES,
    BUDGET_DTYPES,
    COEF_BITS,
    GROUPS,
    IMPLEMENTATIONS,
    LAYER_BUDGETS,
    PRESETS,
    PROJECTION_DTYPES,
    QUANTIZED_BUDGETS,
    SEED_RANGE,
    STORAGES,
    check_choice,
    check_config,
    suggestion,
    to_python_numbers,
)


@dataclass
class VarRateConfig:
    """Configuration of the VarRate codec (one config for every layer of a model)."""

    budget: float = field(
        default=0.20,
        metadata={"group": "paper",
                  "help": "Fraction of the full K/V bytes kept for the prompt, in (0, 1] (paper's kappa)."},
    )
    r_min: int = field(default=16, metadata={"group": "paper", "help": "Rank floor of every coded token (Eq. 5)."})
    rank: int | None = field(
        default=1024,
        metadata={"group": "paper",
                  "help": "Basis rank R; capped at the joint width D and at the loaded basis's rank."},
    )
    stride: int = field(
        default=16, metadata={"group": "paper", "help": (
            "Anchor stride Delta: tokens 0, stride, 2*stride... are exact."
        )},
    )
    n_anchors: int = field(
        default=4, metadata={"group": "paper", "help": (
            "c, the number of nearest anchors a residual is taken to (Eq. 2)."
        )},
    )
    window: int = field(
        default=64, metadata={"group": "paper", "help": (
            "The last `window` prompt tokens are stored exactly."
        )},
    )
    obs_window: int = field(
        default=64, metadata={"group": "paper", "help": (
            "Number of last prompt queries that score salience (Eq. 4)."
        )},
    )
    pool_kernel: int = field(
        default=5, metadata={"group": "paper", "help": (
            "SnapKV moving-average length over adjacent tokens (odd)."
        )},
    )
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
        metadata={"group": "paper",
                  "help": "'waterfill' (Eq. 5) or 'topk' (binary split: winners at R, the rest at r_min); beyond the "
                  "paper, 'distortion': each token's rank from its own coefficients, so that the ranks leave the "
                  "least residual energy uncoded in the same total (transform coding's allocation; needs "
                  "signal='uniform')."},
    )
    storage: str = field(
        default="compact",
        metadata={"group": "runtime",
            "help": "'compact' (hold only the codes and exact tokens: the cache takes the footprint fraction of "
            "memory; the model's sdpa attention reads them directly, any other use rebuilds the layer's K/V) or "
            "'materialized' (reconstruct the prompt once and hold full-length K/V next to the codes, as the "
            "paper does: 1.15x a DynamicCache's bytes, fastest decoding)."
        },
    )
    hold_dtype: str = field(
        default="auto",
        metadata={"group": "runtime",
            "help": "How a prompt is held from its prefill until it is coded: 'auto' in float16 when the model "
            "computes in float32 (e.g. on CPU; half the K/V bytes at the prefill's peak; its forward attends to "
            "its own tokens exactly, and what is coded, exact tokens included, carries fp16 rounding, ~0.05%), "
            "else in the model's dtype; 'model' always in the model's dtype (a float32 model's exact tokens "
            "then stay bit for bit). A layer whose K/V exceed float16's range is held in the model's dtype."
        },
    )
    min_turn_tokens: int | None = field(
        default=256,
        metadata={"group": "runtime",
            "help": "A later turn (what arrives in multi-token forwards after the prompt is coded, e.g. a second "
            "document pasted into a chat) with at least this many tokens is coded as a segment of its own once "
            "complete; shorter turns and decoded tokens stay exact. None keeps every later token exact."
        },
    )
    coef_bits: int | None = field(
        default=None,
        metadata={"group": "paper",
                  "help": "Quantize coefficients to 2, 3, 4 or 8 bits, group-wise (Section 3.3, App. A.4; 2 bits is "
                  "beyond the paper, and lost to 3 at budget 0.1: docs/accuracy_dev.md); None keeps them in the "
                  "model's dtype."},
    )
    coef_group: int = field(
        default=32,
        metadata={"group": "paper",
                  "help": "Coefficients per quantization group (each group stores an fp16 min and step)."},
    )
    coef_scales: str = field(
        default="token",
        metadata={"group": "beyond",
                  "help": "With coef_bits, where the quantization scales sit: 'token' (the paper) gives each group of "
                  "coef_group coefficients of one token an fp16 min and step; 'component' gives each component one "
                  "per component_tokens coded tokens (KIVI's layout for keys), so trailing components keep their "
                  "precision and more rank fits the bytes; where ranks vary (a salience signal, or "
                  "allocation='distortion') the groups are of tokens by decreasing rank, each group's scales only as "
                  "wide as its widest token. Needs allocation='waterfill' or 'distortion', "
                  "quantized_budget='same_bytes'."},
    )
    component_tokens: int = field(
        default=64,
        metadata={"group": "beyond",
                  "help": "With coef_scales='component': consecutive coded tokens that share each component's min and "
                  "step. More tokens: fewer scale bytes, so more rank, over wider ranges."},
    )
    quantized_budget: str = field(
        default="same_ranks",
        metadata={"group": "paper",
                  "help": "With coef_bits: 'same_ranks' allocates ranks as for unquantized coefficients and stores "
                  "fewer bytes (paper, App. A.4); 'same_bytes' holds the byte budget and spends the saving on rank."},
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
                  "'bfloat16', 'float32'); None: the cache's own dtype. 'float16' sizes a cache computed in fp32 "
                  "(e.g. on CPU) exactly as an fp16 deployment would be sized: same ranks, so quantized coefficients "
                  "are not flattered. Never wider than the K/V's dtype (the cache would exceed its budget)."},
    )
    projection_dtype: str = field(
        default="float32",
        metadata={"group": "runtime",
                  "help": "dtype of the projection matmuls (encode c = V e, decode V^T c): 'float32' (the paper); "
                  "'bfloat16' (fp32 accumulation and fp32 anchor means: the coefficients and the decoded "
                  "correction carry bf16 rounding, ~0.4%; 3-5x faster matmuls on GPUs and on CPUs with AMX or "
                  "AVX-512 BF16, slower elsewhere); 'auto': bfloat16 where the device multiplies it natively, else "
                  "float32. Distances and salience are always fp32."},
    )
    basis_bits: int | None = field(
        default=8,
        metadata={"group": "coding",
            "help": "Hold each layer's coding basis (a per-model copy, shared by every cache on the same bases) in 8 "
            "bits, a scale per row and half (about 1% error per basis vector, 0.01-0.15 points added to the codec's "
            "relative K/V error; half a 16-bit basis's bytes), or None: in the stored dtype. The prompt is coded and "
            "read with the same basis, so a saved cache keeps the setting it was coded with."
        },
    )
    # beyond the paper; every one is off in the paper's defaults
    balance: str = field(
        default="none",
        metadata={"group": "beyond",
                  "help": "'rms' scales the value half of z_t so that keys and values carry equal calibration "
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
        metadata={"group": "beyond",
                  "help": "Rank floor as a share of the flat rank B / C: every coded token gets at least "
                  "max(r_min, flat_floor * B / C), so a stale salience signal cannot starve a token. In [0, 1]; "
                  "1 is flat allocation."},
    )
    anchor_share: float | None = field(
        default=None,
        metadata={"group": "beyond",
                  "help": "Budget-aware stride: the exact set (anchors + window) may take at most this share of "
                  "the budget; the stride doubles until it does (at most until n_anchors anchors remain). None "
                  "keeps the stride, and a budget too small for the exact set stores the prompt exactly."},
    )
    layer_budgets: str = field(
        default="uniform",
        metadata={"group": "beyond",
                  "help": "'uniform': every layer gets the budget (the paper); 'spectrum': the layers share their "
                  "coefficient bytes by their calibration spectra, each keeping the directions above one common "
                  "share of its residual energy (at least half the flat rank), so that rank goes where it removes "
                  "the most relative error (needs bases with a spectrum); 'measured': each layer's budget is scaled "
                  "(0.5-2x, the same bytes in all) to where its error moves the model's predictions most, as measured "
                  "on calibration text at the nearest budget the bases record, in the bytes they were counted in "
                  "(`hf-varrate measure-layers`)."},
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
        to_python_numbers(self)
        check_config(self)
        object.__setattr__(self, "_checked", True)

    @classmethod
    def preset(cls, name: str, **overrides) -> VarRateConfig:
        """A named set of defaults: 'paper' (Section 4.1, for reproduction: every option beyond the paper off)
        or 'recommended' (options beyond the paper chosen on a development split; see docs/): 4-bit
        coefficients at the same bytes, anchors held to a quarter of the budget, key/value balance,
        uniform ranks (under reuse no salience signal we tried beat them), and bf16 projection matmuls where
        the device multiplies bf16 natively. At a budget of 0.1 or less it also shortens the exact window to 16
        tokens, quantizes coefficients to 3 bits and scales each layer's budget by its measured sensitivity
        (`low_budget_settings`; `layer_budgets="measured"` needs bases that carry the measurement)."""
        check_choice("preset", name, PRESETS)
        base = {} if name == "paper" else {**RECOMMENDED_PRESET, **cls.low_budget_settings(name, overrides)}
        return cls(**{**base, **overrides})

    @classmethod
    def low_budget_settings(cls, preset: str, overrides: dict) -> dict:
        """What `preset` changes at the budget in `overrides` (the default's when absent): 'recommended' at 0.1
        or less takes `LOW_BUDGET_PRESET`; otherwise nothing."""
        budget = overrides.get("budget", cls.__dataclass_fields__["budget"].default)
        low = preset == "recommended" and isinstance(budget, (int, float)) and budget <= LOW_BUDGET
        return dict(LOW_BUDGET_PRESET) if low else {}

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
                raise TypeError(f"VarRateConfig has no field {name!r}{suggestion(name, known)}; its fields are "
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
            hints = "".join(suggestion(name, known) for name in unknown)
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

# Chosen at budget 0.1 on the development splits of both shipped models, confirmed on held-out ones (SmolLM2 2K
# needles: +29 points over the preset alone; Gemma-3 4K multi-key: +20; docs/accuracy_dev.md, round 3). At 0.2
# the short window ties the 64-token one (and never won on Gemma-3), so it applies at 0.1 and below only.
# Per-layer budgets from measured sensitivity joined later, chosen the same way (Gemma-3 4K multi-key: +20.8 dev,
# +37.5 held-out; SmolLM2 2K: a tie on dev, +16.7 held-out; at 0.2 they lost two answers held out on SmolLM2 4K:
# round 7); bases that carry no measurement keep uniform budgets (`Bases.config`).
LOW_BUDGET = 0.1
LOW_BUDGET_PRESET = {"window": 16, "coef_bits": 3, "layer_budgets": "measured"}
LOW_BUDGET_KEY = "low_budget"  # in bases' tuned settings (`Bases.tuned_settings`): what a preset adds at LOW_BUDGET
