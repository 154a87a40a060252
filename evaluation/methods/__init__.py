"""Method registry: a method spec's `kind` -> its class."""

from __future__ import annotations

from .base import Compressed, Context, Unsupported
from .full import FullMethod
from .kivi import KiviMethod

KINDS = ("full", "varrate", "kvpress", "kivi")


def make_method(name: str, spec: dict):
    kind = spec.get("kind")
    if kind == "full":
        return FullMethod(name, spec)
    if kind == "kivi":
        return KiviMethod(name, spec)
    if kind == "varrate":
        from .varrate import VarRateMethod

        return VarRateMethod(name, spec)
    if kind == "kvpress":
        from .kvpress_methods import KVPressMethod

        return KVPressMethod(name, spec)
    raise ValueError(f"method {name!r}: kind must be one of {list(KINDS)}, got {kind!r}")


__all__ = ["Compressed", "Context", "KINDS", "Unsupported", "make_method"]
