"""Calibration across processes (torch.distributed): shard the contexts, sum the moments, agree on one result.

Launched with `torchrun --nproc_per_node N -m hf_varrate.calibration ...` (or `accelerate launch`), each
process runs the model on `contexts[rank::world_size]`; the fp64 second moments and residual counts are
summed over processes (all-reduce) before the eigen-decomposition, and rank 0's eigenvectors are
broadcast, so every process returns bit for bit the same `Bases`. Only rank 0 writes files (the command
line checks `is_main_process`). The sum of moments is the moment of all residuals, so N processes give
the bases one process gives, up to the order of fp64 additions. A process that fails stops every process
(`all_or_none`), rather than leaving them waiting in a collective.

A process group that is already initialized (accelerate, or the caller's own `init_process_group`) is
used as it is; otherwise one is initialized when torchrun's variables say there is more than one
process (WORLD_SIZE > 1, with RANK and MASTER_ADDR): gloo for a model on CPU, nccl on CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from .pca import SecondMoments

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """Where this process stands: its rank among `world_size` processes (a world of 1: no process group)."""

    rank: int = 0
    world_size: int = 1

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def shard(self, items: list) -> list:
        """This process's share: every world_size-th item from its rank (contexts[rank::world_size])."""
        return items[self.rank :: self.world_size]


def launched() -> bool:
    """True when torchrun (or accelerate launch) started this process as one of several."""
    return all(name in os.environ for name in LAUNCH_VARIABLES) and int(os.environ["WORLD_SIZE"]) > 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def current_group(device: torch.device | str = "cpu", initialize: bool = True) -> Group:
    """The process group calibration runs in: the initialized one, one initialized from torchrun's
    variables (if `initialize`; on `device`'s backend), or a world of one process."""
    if not dist.is_available():
        return Group()
    if not dist.is_initialized():
        if not (initialize and launched()):
            return Group()
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device if device.index is not None else local_rank())
        dist.init_process_group(backend=backend_for(device))
    return Group(dist.get_rank(), dist.get_world_size())


def local_rank() -> int:
    """This process's index on its machine (LOCAL_RANK, set by torchrun and accelerate)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    """Rank 0, or the only process: the one that writes files and prints."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def all_or_none(group: Group, step: Callable[[], T]) -> T:
    """`step()` on every process of `group`, then agree that all finished before any goes on: a process
    whose step raised re-raises, and the others raise a RuntimeError naming it, instead of waiting for it in
    the next collective (gloo's and nccl's default timeouts are 30 minutes and more)."""
    if not group.active:
        return step()
    result, failure = None, None
    try:
        result = step()
    except Exception as error:  # raised below, once every process knows
        failure = error
    flags = [torch.zeros(1, dtype=torch.int64, device=_collective_device()) for _ in range(group.world_size)]
    dist.all_gather(flags, torch.tensor([int(failure is not None)], dtype=torch.int64, device=flags[0].device))
    failed = [rank for rank, flag in enumerate(flags) if int(flag)]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"calibration failed on process(es) {failed} of {group.world_size} (their own error is "
                           f"in their output); process {group.rank} stops too instead of waiting for them")
    return result


def reduce_moments(moments: SecondMoments) -> None:
    """Sum every process's moments and counts in place (all-reduce), layer by layer.

    On nccl the tensors travel through this process's GPU (nccl reduces CUDA tensors only)."""
    device = _collective_device()
    for i in sorted(moments.moments):
        total = moments.moments[i].to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        moments.moments[i] = total.to(moments.moments[i].device)
    layers = sorted(moments.counts)
    counts = torch.tensor([moments.counts[i] for i in layers], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    moments.counts = dict(zip(layers, counts.tolist()))


def broadcast_components(bases: dict[int, torch.Tensor], singular: dict[int, torch.Tensor]) -> None:
    """Overwrite every process's bases [R, D] and singular values [R] with rank 0's, in place, so that
    all processes hold the same bits even where eigen-solvers differ between devices."""
    device = _collective_device()
    for tensors in (bases, singular):
        for i in sorted(tensors):
            shared = tensors[i].to(device).contiguous()
            dist.broadcast(shared, src=0)
            tensors[i] = shared.to(tensors[i].device)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
