"""A decoding step reads nothing back to the host: on a GPU every `.item()`, `.tolist()`, `int(tensor)`,
`bool(tensor)`, `.cpu()` or data-dependent shape (`nonzero`, boolean indexing) in the library's read waits
for the device, once per layer and token. Counted here on the CPU with a `TorchFunctionMode` during the
one-token forwards after the prefill, for the compact read (under the "varrate" attention, and under sdpa,
which reads the codes too) and the materialized storage, with the C loops and without (the path a GPU runs).

The count covers calls made from the library's code (a frame under ``hf_varrate/``), except inside
`codec/ops.py`: those are the CPU kernels of the C loops, which never run on another device. What
transformers itself reads back is not the library's to fix; `test_the_counter_sees_each_kind_of_host_read`
checks the counter."""

import contextlib
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hf_varrate
from hf_varrate import VarRateCache
from hf_varrate.codec import native

from test_attention import attention, compact  # noqa: F401 (fixture)
from test_cache import SMALL, prompt

PACKAGE = str(Path(hf_varrate.__file__).parent)
CPU_KERNELS = str(Path(PACKAGE) / "codec" / "ops.py")
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
         "masked_select", "unique", "unique_consecutive", "equal", "allclose", "is_nonzero"}


class HostReads(TorchFunctionMode):
    """Records each call that reads a tensor back to the host, with the library frame that made it."""

    def __init__(self, root: str = PACKAGE):
        super().__init__()
        self.root, self.found = root, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._reads(getattr(func, "__name__", ""), args, kwargs):
            where = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(self.root)]
            if where and where[-1].filename != CPU_KERNELS:
                self.found.append(f"{func.__name__} at "
                                  f"{Path(where[-1].filename).relative_to(self.root)}:{where[-1].lineno}")
        return func(*args, **kwargs)

    @staticmethod
    def _reads(name, args, kwargs) -> bool:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].device.type == "meta":
            return False
        if name in READS:
            return True
        if name == "to":  # an explicit copy to the host
            return any(a == "cpu" or (isinstance(a, str) and a.startswith("cpu:"))
                       for a in (*args[1:], *kwargs.values()))
        if name == "repeat_interleave":  # tensor repeats without output_size: the size is read back
            return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) and \
                kwargs.get("output_size") is None
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):  # boolean masks index through nonzero
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return False


def decode_steps(model, cache, *, steps=(1, 1, 1), mask: bool = True):
    """Prefill 300 tokens and take one step (which codes the prompt); then the host reads of forwards of `steps`
    tokens each (1: decoding; more: e.g. assisted generation's drafts), with a 0/1 attention mask as
    generate passes it, or none."""
    ids = prompt(model, 300)
    counter = HostReads()
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(ids[:, -1:], past_key_values=cache)
        length = ids.shape[1] + 1
        with counter:
            for new in steps:
                length += new
                kwargs = {"attention_mask": torch.ones(1, length, dtype=torch.long)} if mask else {}
                model(ids[:, -new:], past_key_values=cache, **kwargs)
    return counter.found


@pytest.mark.parametrize("loops", ["torch", "native"])
@pytest.mark.parametrize("overrides, mask", [({"coef_bits": 4}, True), ({"coef_bits": 4}, False), ({}, True),
                                             ({"signal": "uniform", "coef_bits": 4}, True),
                                             ({"preset": "recommended", "budget": 0.3, "projection_dtype": "float32"},
                                              True)])
def test_a_compact_read_over_the_codes_reads_nothing_back(tiny_llama, attention, overrides, loops, mask):  # noqa: F811
    if loops == "native" and not native.available():
        pytest.skip("the C loops could not be built here (no compiler?)")
    attention(tiny_llama, hf_varrate.ATTENTION)
    cache = compact(tiny_llama, **overrides)
    with native.disabled() if loops == "torch" else contextlib.nullcontext():
        found = decode_steps(tiny_llama, cache, mask=mask)
    assert cache.layers[0].attends_codes(None)
    assert found == []


@pytest.mark.parametrize("loops", ["torch", "native"])
def test_a_several_token_forward_over_the_codes_reads_back_only_its_padding_check(
        tiny_llama, attention, loops):  # noqa: F811
    """Forwards of several tokens after the prompt (drafts, later turns) pass the prefill hook, whose padding
    check (`binding.key_padding`: is every token real?) reads one bool per layer; the read itself reads nothing."""
    if loops == "native" and not native.available():
        pytest.skip("the C loops could not be built here (no compiler?)")
    attention(tiny_llama, hf_varrate.ATTENTION)
    with native.disabled() if loops == "torch" else contextlib.nullcontext():
        found = decode_steps(tiny_llama, compact(tiny_llama, coef_bits=4), steps=(5, 1, 3))
    assert {where.split(":")[0] for where in found} <= {"__bool__ at binding.py"}
    assert len(found) <= 2 * tiny_llama.config.num_hidden_layers  # the two forwards of several tokens


@pytest.mark.parametrize("fixture, attn", [("tiny_llama", "sdpa"), ("tiny_llama", hf_varrate.ATTENTION),
                                           ("tiny_gemma3", "sdpa")])
@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_each_storage_under_sdpa_or_varrate_reads_nothing_back(fixture, attn, storage, request,
                                                               attention):  # noqa: F811
    """Materialized storage, and compact storage under either attention (under sdpa a compact layer hands
    sdpa stand-ins that read its codes)."""
    model = request.getfixturevalue(fixture)
    attention(model, attn)
    cache = VarRateCache(hf_varrate.Bases.identity(model.config), model=hf_varrate.bind(model), budget=0.4,
                         coef_bits=4, storage=storage, **SMALL)
    with native.disabled():
        assert decode_steps(model, cache) == []


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_gemma3"])
def test_compact_reads_of_other_architectures_read_nothing_back(fixture, request, attention):  # noqa: F811
    model = request.getfixturevalue(fixture)
    attention(model, hf_varrate.ATTENTION)
    with native.disabled():
        assert decode_steps(model, compact(model, coef_bits=4)) == []


def test_the_counter_sees_each_kind_of_host_read():
    x, reads = torch.arange(6.0), {
        "item": lambda x: x.sum().item(), "tolist": lambda x: x.tolist(), "cpu": lambda x: x.cpu(),
        "to": lambda x: x.to("cpu"), "__int__": lambda x: int(x[0]), "__float__": lambda x: float(x[0]),
        "__bool__": lambda x: bool(x[0]), "__getitem__": lambda x: x[x > 2], "nonzero": lambda x: x.nonzero(),
        "repeat_interleave": lambda x: torch.repeat_interleave(x, torch.ones(6, dtype=torch.long)),
        "__index__": lambda x: list(range(10))[x[1].long()]}
    for name, read in reads.items():
        counter = HostReads(root=str(Path(__file__).parent))  # this file's calls
        with counter:
            read(x)
            torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)  # not a read
            x.to(x.device), x[x.long()]  # not reads
        assert [found.split(" at ")[0] for found in counter.found] == [name]
    library = HostReads()
    with library:
        hf_varrate.codec.quantization.group_sizes(torch.tensor([3, 0, 5]), 2)  # no group count: it is read back
        reads["item"](x)  # the test's own reads are not the library's
    assert len(library.found) == 1 and library.found[0].startswith("__int__ at codec/quantization.py:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_the_gpu_benchmarks_stop_with_the_reason_where_there_is_no_cuda():
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    done = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "sees no CUDA device" in done.stderr and "CUDA build of torch" in done.stderr
