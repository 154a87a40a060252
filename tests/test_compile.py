"""torch.compile over the codes: the C loops are torch custom ops (``hf_varrate::*``) with fake
implementations, so a compiled read, and a compiled model generating over a compact cache, trace them as
graph nodes, run them on real memory, and give eager's results."""

import contextlib
import gc

import pytest
import torch
import torch._dynamo

import hf_varrate
from hf_varrate import VarRateCache
from hf_varrate.codec import native, ops
from hf_varrate.codec.quantization import dequantize_runs, quantize

from test_attention import attention, compact  # noqa: F401 (fixture)
from test_cache import prompt
from test_native import same_bits

needs_native = pytest.mark.skipif(not native.available(), reason="the C loops could not be built here (no compiler?)")
OPS = ("dequantize_runs", "coded_key_scores", "anchor_keys", "add_anchor_shares")


@pytest.fixture
def fresh_dynamo():
    """Compiled code and its guards do not outlive a test (a graph keeps what `native.available()` said)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()  # the traced graphs' fake tensors go with the compiled code


def recording(seen: list):
    """A backend that notes the graph's call targets, then runs it as aot_eager (functionalized, as
    inductor would see it, without compiling C++)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return aot_eager(gm, example_inputs)

    return backend


def coded_layer(model, overrides):
    """The first layer of a compact cache that has coded a 299-token prompt, under the "varrate" attention."""
    cache = compact(model, **overrides)
    ids = prompt(model, 300)
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache)
        model(ids[:, -1:], past_key_values=cache)  # the first decoding step codes the prompt
    layer = cache.layers[0]
    assert layer.attends_codes(None)
    return layer


@pytest.mark.parametrize("overrides", [{"coef_bits": 4},  # the preset's projection_dtype 'auto' asks the machine
                                       {"preset": "recommended", "budget": 0.3}])
@pytest.mark.parametrize("loops", ["native", "torch"])
def test_a_compiled_read_over_the_codes_equals_the_eager_read(tiny_llama, overrides, loops, attention,  # noqa: F811
                                                              fresh_dynamo):
    if loops == "native" and not native.available():
        pytest.skip("the C loops could not be built here (no compiler?)")
    attention(tiny_llama, hf_varrate.ATTENTION)
    layer = coded_layer(tiny_llama, overrides)
    query, seen = torch.randn(1, 4, 2, 16, generator=torch.Generator().manual_seed(0)), []
    with native.disabled() if loops == "torch" else contextlib.nullcontext():
        want = layer.attend(query, None, 0.25)
        got = torch.compile(lambda q: layer.attend(q, None, 0.25), backend=recording(seen), fullgraph=True)(query)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    used = {name for name in OPS if f"hf_varrate.{name}.default" in seen}
    assert used == ({"coded_key_scores", "anchor_keys", "add_anchor_shares"} if loops == "native" else set())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_dequantization_runs_the_c_loop_bit_for_bit(dtype, fresh_dynamo):
    runs, seen = [(0, 7, 40), (7, 20, 39)], []
    coefs = quantize(torch.randn(7 * 40 + 13 * 39, generator=torch.Generator().manual_seed(1)),
                     torch.tensor([40] * 7 + [39] * 13), 4, 32)
    compiled = torch.compile(lambda c: native.dequantize_runs(c, runs, dtype), backend=recording(seen), fullgraph=True)
    got = compiled(coefs)
    with native.disabled():
        want = dequantize_runs(coefs, type("Layout", (), {"runs": runs, "width": None})).to(dtype)
    assert "hf_varrate.dequantize_runs.default" in seen
    assert got.dtype == dtype and same_bits(got, want)


@pytest.mark.slow
def test_inductor_compiles_the_positions_of_the_coded_tokens(fresh_dynamo):
    """Under inductor (CPU C++), k + k // (stride - 1) + 1 over an arange compiled to a loop that skipped the
    last C mod (stride - 1) positions, which the read then passed to its loops as garbage. ~30 s."""
    from hf_varrate.codec.anchors import coded_positions, exact_mask

    compiled = torch.compile(coded_positions, backend="inductor", fullgraph=True)
    for seq_len, stride, window in [(1023, 128, 64), (300, 8, 16), (50, 1, 4)]:
        want = (~exact_mask(seq_len, stride, window)).nonzero()[:, 0]
        assert torch.equal(compiled(seq_len, stride, window), want)


def _op_samples():
    gen = torch.Generator().manual_seed(2)
    coefs = quantize(torch.randn(60, generator=gen), torch.full((6,), 10), 3, 8)
    turns, weights = torch.randn(20, 4, 2, generator=gen), torch.rand(2, 3, 15 + 9 + 2, generator=gen)
    coded, exact, _ = weights.split((15, 9, 2), dim=-1)
    return {
        "dequantize_runs": (coefs.codes, 3, coefs.steps.float(), coefs.mins.float(), torch.tensor([[0, 6, 10]]), 8, 0,
                            60, True),
        "coded_key_scores": (torch.randn(15, 16, generator=gen), torch.randn(5, 16, generator=gen),
                             torch.randint(5, (15, 2), generator=gen), turns, torch.randperm(20, generator=gen)[:15],
                             torch.randn(2, 3, 8, generator=gen)),
        "anchor_keys": (torch.randn(2, 9, 8, generator=gen), torch.tensor([0, 3, 6]), torch.tensor([0, 4, 8]),
                        turns, 2),
        "add_anchor_shares": (coded, exact, torch.randint(5, (15, 2), generator=gen), torch.tensor([0, 2, 4, 6, 8])),
    }


@needs_native
@pytest.mark.parametrize("name", OPS)
def test_each_op_passes_torch_library_opcheck(name):
    """Schema (what the op mutates), fake implementation (shapes, dtypes) and dispatch, as torch checks them."""
    torch.library.opcheck(getattr(ops, name), _op_samples()[name],
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_native
def test_compiling_leaves_the_c_loops_in_use(monkeypatch):
    """No compile guard: while torch.compile traces, the read still takes the C loops (as custom ops)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert native.available()


@pytest.mark.slow
def test_compiled_generate_over_the_default_compact_cache_under_sdpa_gives_eager_tokens(tiny_llama, fresh_dynamo):
    """The default: compact storage read over its codes under the model's sdpa. Graph breaks (the prefill's
    data-dependent steps) are allowed; the tokens must be eager's. ~45 s on CPU."""
    from test_cache import SMALL

    ids = prompt(tiny_llama, 300)

    def run():
        cache = VarRateCache(hf_varrate.Bases.identity(tiny_llama.config), model=hf_varrate.bind(tiny_llama),
                             budget=0.4, coef_bits=4, **SMALL)
        with torch.no_grad():
            return tiny_llama.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache, pad_token_id=0)

    expected = run()
    tiny_llama.forward = torch.compile(tiny_llama.forward, backend="eager")
    try:
        assert torch.equal(run(), expected)
    finally:
        del tiny_llama.forward


def test_compiled_generate_on_the_real_model_gives_eager_tokens(smollm2, fresh_dynamo):
    """torch.compile(model.forward) + generate with a compact cache under the "varrate" attention on SmolLM2:
    the same greedy tokens as eager. Dynamo's tracing runs the ops' fake implementations. About a minute
    on two CPU cores."""
    model, tokenizer = smollm2
    ids = prompt(model, 400)
    previous = model.config._attn_implementation
    model.set_attn_implementation(hf_varrate.ATTENTION)

    def run():
        cache = VarRateCache(hf_varrate.Bases.identity(model.config), model=model, budget=0.4, storage="compact",
                             coef_bits=4)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                  past_key_values=cache, pad_token_id=2)

    try:
        with hf_varrate.bound(model):
            expected = run()
            model.forward = torch.compile(model.forward, backend="eager")
            try:
                got = run()
            finally:
                del model.forward
    finally:
        model.set_attn_implementation(previous)
    assert torch.equal(got, expected)
