"""Calibration on two processes (gloo, CPU) gives the bases of one process; only rank 0 writes.

The two processes are started with torch.multiprocessing's spawn and given torchrun's variables
(WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) without a process group, so `calibrate` must initialize one
itself, as it does under `torchrun`. Each builds the same tiny random model from the same seed.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY_SHAPE, _build_tiny
from transformers import LlamaConfig

from hf_varrate import Bases
from hf_varrate.calibration import calibrate
from hf_varrate.calibration import __main__ as cli
from hf_varrate.calibration.distributed import Group, current_group, is_main_process, launched

WORLD = 2
TOP = 16


def token_contexts(count: int = 5, length: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 128, (length,), generator=g) for _ in range(count)]


class CharTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [2 + ord(c) % 120 for c in text]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str, texts: str) -> None:
    """One process: calibrate through the library (initializing the group from the variables), then
    through the command line, recording which ranks called save_pretrained."""
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = _build_tiny(LlamaConfig(**TINY_SHAPE))
    try:
        bases = calibrate(model, token_contexts(), progress=False)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        torch.save({"tensors": dict(bases.tensors), "meta": bases.metadata}, os.path.join(out, f"api-{rank}.pt"))
        saver = Bases.save_pretrained

        def recording_save(self, path, **kwargs):
            open(os.path.join(out, f"saved-by-{rank}"), "w").close()
            return saver(self, path, **kwargs)

        Bases.save_pretrained = recording_save  # this child process only
        cli.load_model = lambda args: (model, CharTokenizer(), {"model_id": "tiny/llama"})
        cli.main(["--texts", texts, "--num-contexts", "4", "--context-length", "200", "--rank", str(TOP),
                  "--out", os.path.join(out, "bases"), "--quiet"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def principal_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosines of the principal angles between the row spaces of a [k, D] and b [k, D] (orthonormal rows)."""
    return torch.linalg.svdvals(a.double() @ b.double().T)


def test_two_processes_give_the_bases_of_one(tmp_path, tiny_llama):
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps([f"document {i} " * 30 for i in range(12)]))
    mp.spawn(_worker, args=(free_port(), str(tmp_path), str(texts)), nprocs=WORLD, join=True)
    single = calibrate(tiny_llama, token_contexts(), progress=False)
    assert single.metadata["world_size"] == 1
    results = [torch.load(tmp_path / f"api-{rank}.pt") for rank in range(WORLD)]
    for i in (0, 1):
        assert torch.equal(results[0]["tensors"][i], results[1]["tensors"][i])  # every process agrees, bit for bit
        cosines = principal_cosines(results[0]["tensors"][i][:TOP], single.tensors[i][:TOP])
        assert float(cosines.min()) >= 0.999, (i, cosines)
    meta = results[0]["meta"]
    assert meta["world_size"] == WORLD and meta["num_contexts"] == 5
    assert meta["num_samples"] == single.metadata["num_samples"]  # counts summed over processes
    assert sorted(p.name for p in tmp_path.glob("saved-by-*")) == ["saved-by-0"]  # only rank 0 writes
    saved = Bases.from_pretrained(tmp_path / "bases")
    assert saved.metadata["world_size"] == WORLD and saved.rank == TOP
    assert json.loads((tmp_path / "bases" / "config.json").read_text())["world_size"] == WORLD


def test_one_process_is_a_world_of_one(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not launched() and current_group() == Group() and is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not launched()


@pytest.mark.parametrize("rank, expected", [(0, [0, 3, 6]), (1, [1, 4]), (2, [2, 5])])
def test_contexts_are_shared_out_by_rank(rank, expected):
    assert Group(rank, 3).shard(list(range(7))) == expected


def _failing_worker(rank: int, port: int, out: str) -> None:
    """One process of two, where process 1's share fails: record what each one raises."""
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import importlib

    calibration = importlib.import_module("hf_varrate.calibration.calibrate")  # the module (the package's
    # attribute of that name is the function)

    if rank == 1:
        def broken(*args, **kwargs):
            raise ValueError("this process's contexts could not be run")
        calibration.accumulate = broken  # this child process only
    model = _build_tiny(LlamaConfig(**TINY_SHAPE))
    try:
        calibrate(model, token_contexts(), progress=False)
        outcome = "returned"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out, f"outcome-{rank}.txt"), "w") as f:
        f.write(outcome)


def test_a_failing_process_stops_every_process_instead_of_leaving_them_waiting(tmp_path):
    """Process 1's share fails: it raises its own error, and process 0 a RuntimeError naming it, before either
    enters the moments' all-reduce. Without that agreement process 0 waits there for the failed process:
    until nccl's timeout, or (gloo, once process 1 has exited) to an opaque 'Connection closed by peer'."""
    context = mp.start_processes(_failing_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("process 0 was left waiting for the failed process 1")
    outcomes = [(tmp_path / f"outcome-{rank}.txt").read_text() for rank in range(WORLD)]
    assert outcomes[1] == "ValueError: this process's contexts could not be run"  # its own error
    assert outcomes[0].startswith("RuntimeError: calibration failed on process(es) [1] of 2")
