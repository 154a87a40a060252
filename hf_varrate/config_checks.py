"""The checks of a `VarRateConfig` and the values each field allows: every error names the field, the
allowed values, the value received and the fix. `hf_varrate.config` re-exports the allowed values."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import warnings

from .errors import VarRateWarning
from .signals import SIGNALS

GROUPS = ("paper", "beyond", "runtime", "coding", "developer")  # coding: fixed once a prompt is coded
ALLOCATIONS = ("waterfill", "topk", "distortion")
STORAGES = ("materialized", "compact")
HOLD_DTYPES = ("auto", "model")
BASIS_BITS = (8, None)
IMPLEMENTATIONS = ("fast", "reference")
COEF_BITS = (None, 2, 3, 4, 8)
QUANTIZED_BUDGETS = ("same_ranks", "same_bytes")
COEF_SCALES = ("token", "component")
BALANCES = ("none", "rms")
BUDGET_DTYPES = (None, "float16", "bfloat16", "float32")
LAYER_BUDGETS = ("uniform", "spectrum", "measured")
PROJECTION_DTYPES = ("float32", "bfloat16", "auto")
PRESETS = ("paper", "recommended")
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes


def check_config(config) -> None:
    """Raise ValueError naming the field, the allowed values, the value received and the fix."""
    check_range("budget", config.budget, 0.0, 1.0, low_open=True, fix="use e.g. budget=0.2 (keep 20%)")
    check_int(config, "r_min", config.r_min, 0)
    if config.rank is not None:
        check_int(config, "rank", config.rank, 1)
        if config.r_min > config.rank:
            raise ValueError(
                f"r_min must be <= rank, got r_min={config.r_min} and rank={config.rank}; "
                f"lower r_min or raise rank"
            )
    check_int(config, "stride", config.stride, 1)
    check_int(config, "n_anchors", config.n_anchors, 1)
    check_int(config, "window", config.window, 1)
    check_int(config, "obs_window", config.obs_window, 1)
    check_int(config, "pool_kernel", config.pool_kernel, 1)
    if config.pool_kernel % 2 == 0:
        raise ValueError(f"pool_kernel must be odd, got {config.pool_kernel}; use e.g. 5")
    check_int(config, "distance_chunk", config.distance_chunk, 1)
    if not isinstance(config.seed, int) or isinstance(config.seed, bool) or \
            not SEED_RANGE[0] <= config.seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer that torch.manual_seed takes (-2**63 to 2**64 - 1), got "
                         f"{config.seed!r}; use e.g. seed=0 (the default)")
    check_choice("signal", config.signal, tuple(SIGNALS))
    check_choice("allocation", config.allocation, ALLOCATIONS)
    if config.allocation == "distortion" and config.signal != "uniform":
        raise ValueError(f"allocation='distortion' ranks each token by its own coefficients and reads no salience "
                         f"signal, got signal={config.signal!r}; set signal='uniform' with it, or use "
                         f"allocation='waterfill' to rank by the signal")
    check_choice("storage", config.storage, STORAGES)
    check_choice("hold_dtype", config.hold_dtype, HOLD_DTYPES)
    check_choice("basis_bits", config.basis_bits, BASIS_BITS)
    if config.coef_bits is not None:
        check_int(config, "coef_bits", config.coef_bits, 1)
    check_choice("coef_bits", config.coef_bits, COEF_BITS)
    check_int(config, "coef_group", config.coef_group, 1)
    check_choice("quantized_budget", config.quantized_budget, QUANTIZED_BUDGETS)
    check_choice("coef_scales", config.coef_scales, COEF_SCALES)
    check_int(config, "component_tokens", config.component_tokens, 1)
    if config.coef_scales == "component":
        check_component_scales(config)
    check_choice("implementation", config.implementation, IMPLEMENTATIONS)
    check_choice("budget_dtype", config.budget_dtype, BUDGET_DTYPES)
    check_choice("balance", config.balance, BALANCES)
    check_choice("layer_budgets", config.layer_budgets, LAYER_BUDGETS)
    check_choice("projection_dtype", config.projection_dtype, PROJECTION_DTYPES)
    check_range("key_weight", config.key_weight, 0.0, 1e6, low_open=True,
                 fix="use e.g. key_weight=4.0 (or 1.0: off)")
    if config.min_turn_tokens is not None:
        check_int(config, "min_turn_tokens", config.min_turn_tokens, 2)
    check_range("flat_floor", config.flat_floor, 0.0, 1.0, fix="use e.g. flat_floor=0.5 (half the flat rank)")
    if config.anchor_share is not None:
        check_range("anchor_share", config.anchor_share, 0.0, 1.0, low_open=True,
                     fix="use e.g. anchor_share=0.25, or None to keep the stride")
    beyond = {"balance": config.balance != "none", "key_weight": config.key_weight != 1.0,
              "signal": not SIGNALS[config.signal].paper,
              "layer_budgets": config.layer_budgets != "uniform", "allocation": config.allocation == "distortion",
              "projection_dtype": config.projection_dtype != "float32", "coef_scales": config.coef_scales != "token"}
    if config.implementation == "reference" and any(beyond.values()):
        name = next(k for k, v in beyond.items() if v)
        raise ValueError(f"implementation='reference' runs the paper's algorithm only, got {name}="
                         f"{getattr(config, name)!r}; use implementation='fast' (the default)")


def check_component_scales(config) -> None:
    """coef_scales='component' quantizes coefficients held at the same bytes, with its scale grid counted in them:
    the bound the budget counts holds for water-filled or distortion ranks, uniform or varying (axis "rank")."""
    conflicts = component_conflicts(config)
    if conflicts:
        name, value = next(iter(conflicts.items()))
        raise ValueError(f"coef_scales='component' needs {name}={value} (a scale per component over groups of "
                         f"tokens fits tokens grouped by rank, in the bytes it is given), got {name}="
                         f"{getattr(config, name)!r}; set {name} so, or use coef_scales='token'")


def component_conflicts(config) -> dict[str, str]:
    """{field: the value coef_scales='component' needs of it} for each field of `config` that rules it out; empty
    when none does."""
    needs = {"coef_bits": (config.coef_bits is not None, "e.g. 3 or 4"),
             "allocation": (config.allocation != "topk", "'waterfill' or 'distortion'"),
             "quantized_budget": (config.quantized_budget == "same_bytes", "'same_bytes'")}
    return {name: value for name, (ok, value) in needs.items() if not ok}


def component_or_token(config, preset: str, *, stacklevel: int) -> str:
    """What a preset's tuned coef_scales='component' becomes beside `config`'s other fields: 'component', or 'token'
    with a VarRateWarning where they rule it out (`component_conflicts`)."""
    conflicts = component_conflicts(config)
    if not conflicts:
        return "component"
    needs = ", ".join(f"{name}={value}" for name, value in conflicts.items())
    got = ", ".join(f"{name}={getattr(config, name)!r}" for name in conflicts)
    warnings.warn(f"preset {preset!r} codes with these bases' tuned coef_scales='component', which needs {needs}; "
                  f"with {got} it uses coef_scales='token' (the paper's per-token scales). Pass coef_scales='token' "
                  f"to silence this", VarRateWarning, stacklevel=stacklevel)
    return "token"


def to_python_numbers(config) -> None:
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
            object.__setattr__(config, f.name, shortest_float(value))


def shortest_float(value) -> float:
    """np.float32(0.4) -> 0.4 (the number the user wrote), not 0.4000000059604645."""
    try:
        return float(str(value))
    except ValueError:
        return float(value)


def suggestion(name, known) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_range(name, value, low, high, *, low_open=False, fix=""):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}; {fix}")


def check_int(config, name, value, minimum):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        default = type(config).__dataclass_fields__[name].default
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}; use e.g. {name}={default} "
                         f"(the default)")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def fall_back(config, preset: str, overrides: dict, *, spectrum: bool, measured: bool, stacklevel: int):
    """`config` with what `preset` asks of bases that lack it replaced, each with a VarRateWarning, unless the
    user set the field in `overrides`: balance='none' without a calibration spectrum, layer_budgets='uniform'
    without a measured sensitivity (`Bases.config`). `stacklevel` is the warning's, counted from this function."""
    lacking = (  # (field, its fallback, whether the bases lack what the preset's value needs, why)
        ("balance", "none", config.balance != "none" and not spectrum,
         f"balances keys and values (balance={config.balance!r}), which needs bases that carry their calibration "
         f"spectrum; these carry none, so balance='none' is used. Recalibrate them with this version "
         f"(hf-varrate calibrate ...) to get it"),
        ("layer_budgets", "uniform", config.layer_budgets == "measured" and not measured,
         f"scales each layer's budget by its measured sensitivity at budget={config.budget}, which these bases do "
         f"not carry, so every layer gets the same budget. Measure them (hf-varrate measure-layers <folder> "
         f"--model ...) to get it"),
    )
    for field, fallback, lacks, why in lacking:
        if lacks and field not in overrides:
            warnings.warn(f"preset {preset!r} {why}, or pass {field}={fallback!r} to silence this", VarRateWarning,
                          stacklevel=stacklevel)
            config = config.replace(**{field: fallback})
    return config
