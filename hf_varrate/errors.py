"""Every exception and warning class hf_varrate raises, in one place.

Each is a `ValueError` (or a `UserWarning`), so code that catches the built-in types keeps working;
catching these names is how a caller tells a bad artifact from a bad argument.
"""

from __future__ import annotations


class VarRateWarning(UserWarning):
    """Something the codec did differently from what was asked, without losing data."""


class CalibrationOverrideWarning(VarRateWarning):
    """A codec setting differs from the one the bases were calibrated with (kept, as asked)."""


class BasesError(ValueError):
    """A bases artifact is missing, corrupt, or does not fit the model it meets."""


class CacheFileError(ValueError):
    """A saved cache is missing, corrupt, or does not fit the model (or bases) it is loaded with."""


class DeviceMismatchError(ValueError):
    """A layer's K/V, or a tensor the cache holds for it, is not on the device that layer runs on."""
