"""`calibrate(model, contexts)`: training-free bases (paper Section 3.1, "Shared basis").

Per compressed layer: stream the residuals of every context into an fp64 D x D second moment,
then keep its top-R eigenvectors, and their singular values (the square roots of the eigenvalues) as
the layer's spectrum. R defaults to min(1024, D) (Section 4.1). Deterministic: the
same model, contexts and settings give the same bases bit for bit on the same machine.

Under torch.distributed (`torchrun`, `accelerate launch`) each process codes its share of the contexts
and the moments are summed before the eigen-decomposition (see `distributed.py`): every process passes
the same contexts and gets the same bases back.
"""

from __future__ import annotations

import platform
import time
import warnings

import torch

from ..architecture import check_compressible, describe
from ..bases import Bases, layout_metadata
from ..config import VarRateConfig
from .distributed import Group, all_or_none, broadcast_components, current_group, reduce_moments
from .collect import ResidualSettings, run_contexts
from .pca import SecondMoments

DEFAULT_RANK = 1024  # the paper's R, capped at D


def calibrate(model, contexts: list[torch.Tensor], *, rank: int | None = None, config: VarRateConfig | None = None,
              progress: bool = True, distributed: bool = True, **metadata) -> Bases:
    """Bases for `model` from `contexts` (LongTensors of token ids, one prefill each).

    `config` supplies stride, window and n_anchors (the defaults: 16, 64, 4), recorded in the
    bases so that `VarRateCache.from_pretrained` codes with the same ones. Extra keyword arguments
    go into the bases' metadata (e.g. calibration="my data", seed=0, model_id="org/name").

    With `distributed` (the default) and more than one process (an initialized process group, or
    torchrun's variables: then a group is initialized), every process must pass the same `contexts`;
    each runs `contexts[rank::world_size]` and all return the same bases, with `world_size` in their
    metadata. Pass False where every process must see every context (e.g. a model split across them).
    """
    if not contexts:
        raise ValueError("calibrate needs at least one context")
    config = config or VarRateConfig()
    shape = check_compressible(describe(model.config))
    rank = min(DEFAULT_RANK, shape.width) if rank is None else rank
    if not 1 <= rank <= shape.width:
        raise ValueError(f"rank must be in [1, {shape.width}] (the joint width D = 2*H*d), got {rank}")
    device = next(model.parameters()).device
    group = current_group(device) if distributed else Group()
    start = time.perf_counter()
    moments = all_or_none(group, lambda: accumulate(model, group.shard(contexts), shape, config,
                                                    progress and group.rank == 0))
    if group.active:
        reduce_moments(moments)
    bases, singular = all_or_none(group, lambda: moments.components(rank))
    if group.active:
        broadcast_components(bases, singular)
    seconds = time.perf_counter() - start
    samples = min(moments.counts.values())
    if samples < rank:
        warnings.warn(f"only {samples} residuals per layer for rank {rank}: the last {rank - samples} directions "
                      f"carry no calibration data; use more or longer contexts", stacklevel=2)
    meta = {
        "calibration": "custom", "num_contexts": len(contexts), "context_length": int(contexts[0].numel()),
        "num_samples": samples, "calibration_seconds": round(seconds, 2), "world_size": group.world_size,
        "calibration_machine": machine_description(device, group.world_size),
        "stride": config.stride, "window": config.window, "n_anchors": config.n_anchors,
        **layout_metadata(model), **metadata,  # the layout and RoPE a cache built without the model reads
    }
    return Bases.from_tensors(bases, model.config, spectra=singular, **meta)


def accumulate(model, contexts: list[torch.Tensor], shape, config: VarRateConfig, progress: bool) -> SecondMoments:
    """The fp64 second moments of the residuals of `contexts` (this process's share), per compressed layer."""
    moments = SecondMoments(shape.width, shape.compressed_layers)
    run_contexts(model, contexts, shape.compressed_layers, moments.add, ResidualSettings.from_config(config), progress)
    return moments


def machine_description(device: torch.device, world_size: int = 1) -> str:
    """Where calibration ran, for the card (times are only comparable on the same machine)."""
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    return machine if world_size == 1 else f"{world_size} processes, each: {machine}"
