"""Which device each layer of the cache lives on, and a clear error when its tensors disagree.

A model split across devices (accelerate's `dispatch_model`, `from_pretrained(device_map=...)`) runs each
decoder layer on its own device (a layer whose weights are offloaded to "cpu" or "disk" runs on the
execution device accelerate's hook gives it), and the cache layer serving it holds everything there:
codes, anchors, exact and appended tokens, the RoPE tables and basis copies it reads with. A layer learns
its device from its first K/V (`DynamicLayer.lazy_initialization`). K/V arriving on another device later,
or a held tensor elsewhere, raises `DeviceMismatchError` naming the layer, the devices and the fix: a
silent copy at every step would hide a wrong placement behind a slow one.

Bottom floor: tensors and modules only, nothing of the package above `errors`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from .errors import DeviceMismatchError

# A layer's attributes that are not its own: shared by every layer of the cache (checked where they are used).
SHARED = frozenset({"bases", "config", "rope", "memo"})

ARRIVAL_FIX = (
    "A VarRateCache layer stays on the device of its first K/V: after moving or re-dispatching the model, start "
    "a new cache (or cache.reset()); with accelerate, run each decoder layer on one device for the cache's life"
)
HELD_FIX = (
    "every tensor a cache layer holds must be on the device its layer runs on. Something moved the cache's "
    "tensors, or the cache was loaded for another placement: load it with VarRateCache.load(directory, model) "
    "for this placement of the model, or prefill a new cache"
)


def held_tensors(obj, name: str = "", skip: frozenset[str] = frozenset(),
                 seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in `obj`: a tensor, a list / tuple / dict of them, a dataclass, or an
    object's attributes (except those named in `skip`: what is shared, not the object's own), followed
    recursively, each object once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield name, obj
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from held_tensors(item, f"{name}[{i}]", seen=seen)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from held_tensors(item, f"{name}[{key!r}]", seen=seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from held_tensors(getattr(obj, f.name), f"{name}.{f.name}".lstrip("."), seen=seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for key, item in vars(obj).items():
            if key not in skip:
                yield from held_tensors(item, f"{name}.{key}".lstrip("."), seen=seen)


def check_held(layer, device=None) -> None:
    """Raise `DeviceMismatchError` if a tensor `layer` holds (its own, not the cache's shared ones) is not on
    `device` (default: the layer's, `layer.device`). Walks every tensor: meant for once per prompt, not per step."""
    device = torch.device(device) if device is not None else getattr(layer, "device", None)
    if device is None:
        return  # never updated: holds nothing
    for name, tensor in held_tensors(layer, skip=SHARED):
        if tensor.device != device:
            raise DeviceMismatchError(
                f"layer {layer.layer_idx}: its {name} is on {tensor.device}, but the layer runs on {device}; "
                f"{HELD_FIX}")


def check_arrival(layer, keys: torch.Tensor, values: torch.Tensor, walk: bool = False) -> None:
    """Raise `DeviceMismatchError` if `keys` / `values` are not on the device `layer` holds its tensors on (one
    comparison, cheap enough for every update); `walk` also checks every tensor it holds (`check_held`)."""
    device = layer.device
    if keys.device != device or values.device != device:
        raise DeviceMismatchError(
            f"layer {layer.layer_idx}: key_states arrived on {keys.device} and value_states on {values.device}, "
            f"but this cache layer holds its tensors on {device}. {ARRIVAL_FIX}")
    if walk:
        check_held(layer, device)


def layer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """{layer index: the device the layer runs on} for every attention module of `model` that records its
    `layer_idx`: the execution device of accelerate's hook on it or a module above it (offloaded weights run
    there), else the device of its parameters that are not on "meta"."""
    found: dict[int, torch.device] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx not in found:
            device = execution_device(model, name)
            if device is not None:
                found[idx] = device
    return found


def execution_device(model: torch.nn.Module, name: str) -> torch.device | None:
    """The device module `name` of `model` runs on (see `layer_devices`), or None if nothing says."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        hook = getattr(model.get_submodule(".".join(parts[:depth])), "_hf_hook", None)
        for one in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            device = getattr(one, "execution_device", None)
            if device is not None:
                return torch.device(device)
    placed = [p.device for p in model.get_submodule(name).parameters() if p.device.type != "meta"]
    return placed[0] if placed else None
