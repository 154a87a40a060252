"""Where a prompt arrives, it is coded: whole, chunked, after a crop or a reset; drafts never are.

The rule (hf_varrate.layers.base): what arrives in multi-token forwards while a layer is empty is the
prompt; it is held exactly, and attended to exactly, until it is complete (the first one-token forward,
or `cache.compress()`, which reading the footprint, saving and copying also call); then it is coded as
one prompt. So a chunked prefill is coded as if it had come whole.
"""

import pytest
import torch
import transformers
from packaging.version import Version

import hf_varrate
from hf_varrate import Bases, VarRateCache

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2, budget=0.3)
OLD_CHUNKING = Version(transformers.__version__) < Version("5.24")


def make_cache(model, **overrides):
    hf_varrate.bind(model)
    return VarRateCache(Bases.identity(model.config), model=model, **{**SMALL, **overrides})


def prompt(model, length=300, seed=0):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, new=8, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, pad_token_id=0,
                              attention_mask=torch.ones_like(ids), **kwargs)


def codes_of(cache):
    return [(code.ranks, code.coefs) for layer in cache.layers if isinstance(layer, hf_varrate.VarRateLayer)
            for code in layer.codes]


def same_codes(a, b, rtol=1e-4, atol=1e-5) -> bool:
    """Same ranks; coefficients equal up to float rounding (a chunked prefill's later chunks attend in pieces,
    so the K/V of layers after the first differ from a whole prefill's in the last bits)."""
    mine, theirs = codes_of(a), codes_of(b)
    return len(mine) == len(theirs) > 0 and all(
        torch.equal(r1, r2) and torch.allclose(c1, c2, rtol=rtol, atol=atol)
        for (r1, c1), (r2, c2) in zip(mine, theirs))


@pytest.mark.parametrize("hold", ["model", "auto"])
@pytest.mark.parametrize("signal", ["uniform", "snapkv"])
@pytest.mark.parametrize("chunk", [64, 100, 256])
@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_a_chunked_prefill_is_coded_as_if_it_came_whole(tiny_llama, chunk, storage, signal, hold):
    """hold_dtype='model': the same codes up to float rounding. 'auto' (the default; this tiny model computes in
    float32): later chunks attend to the earlier ones as held, in float16, so the codes carry that rounding too;
    the same ranks, bytes and answers."""
    if OLD_CHUNKING:
        pytest.skip("transformers < 5.24 numbers every chunk of a chunked prefill from position 0 (its own "
                    "DynamicCache's keys differ from a whole prefill's), so there is no whole prefill to match")
    ids = prompt(tiny_llama, 300)
    whole = make_cache(tiny_llama, storage=storage, signal=signal, hold_dtype=hold)
    expected = greedy(tiny_llama, ids, whole)
    chunked = make_cache(tiny_llama, storage=storage, signal=signal, hold_dtype=hold)
    out = greedy(tiny_llama, ids, chunked, prefill_chunk_size=chunk)
    assert torch.equal(out, expected)
    tolerance = {} if hold == "model" else {"rtol": 1e-2, "atol": 1e-2}
    assert same_codes(chunked, whole, **tolerance) and chunked.layers[0].prompt_len == 300
    assert abs(chunked.footprint().fraction - whole.footprint().fraction) < 1e-9


def test_a_prompt_is_held_exactly_until_it_is_complete(tiny_llama):
    cache = make_cache(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 200), past_key_values=cache)
        tiny_llama(prompt(tiny_llama, 100, seed=1), past_key_values=cache)  # a second chunk of the same prompt
    assert all(layer.holding and not layer.codes for layer in cache.layers)
    assert cache.compress() is cache
    assert all(layer.prompt_len == 300 and layer.codes for layer in cache.layers)


def test_a_document_compressed_once_leaves_the_question_exact(tiny_llama):
    cache = make_cache(tiny_llama)
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 300), past_key_values=cache)
        cache.compress()
        tiny_llama(prompt(tiny_llama, 20, seed=1), past_key_values=cache)
    layer = cache.layers[0]
    assert layer.prompt_len == 300 and layer.appended == 20


@pytest.mark.parametrize("how", ["crop", "reset"])
def test_a_new_prompt_after_a_crop_to_zero_or_a_reset_is_coded(tiny_llama, how):
    cache = make_cache(tiny_llama, storage="compact")
    greedy(tiny_llama, prompt(tiny_llama, 300), cache)
    cache.crop(-cache.get_seq_length()) if how == "crop" else cache.reset()  # every token, on every transformers
    assert cache.get_seq_length() == 0
    greedy(tiny_llama, prompt(tiny_llama, 300, seed=2), cache)
    fresh = make_cache(tiny_llama, storage="compact")
    greedy(tiny_llama, prompt(tiny_llama, 300, seed=2), fresh)
    assert same_codes(cache, fresh)
    assert abs(cache.footprint().fraction - fresh.footprint().fraction) < 1e-9


def test_assisted_generation_never_codes_a_draft_token(tiny_llama):
    """Every forward of assisted generation brings several tokens (the prompt with a draft, then the drafts to
    verify), so the prompt is held exactly throughout; rejected drafts are cropped from exact tokens, and the
    cache codes, saves and reads afterwards."""
    torch.manual_seed(1)
    assistant = type(tiny_llama)(tiny_llama.config).eval()  # another random model: it proposes wrong drafts
    ids = prompt(tiny_llama, 300)
    cache = make_cache(tiny_llama)
    crops, update = [], cache.update

    def watch(keys, values, layer_idx, *args, **kwargs):  # which tokens are coded when drafts are cropped
        if layer_idx == 0 and keys.shape[-2] > 1:
            crops.append(not cache.layers[0].codes)
        return update(keys, values, layer_idx, *args, **kwargs)

    cache.update = watch
    out = greedy(tiny_llama, ids, cache, new=12, assistant_model=assistant)
    assert len(crops) > 1 and all(crops)  # no multi-token forward (prompt + draft, drafts) found anything coded
    reference = greedy(tiny_llama, ids, None, new=12, assistant_model=assistant)
    assert torch.equal(out[:, :-1], reference[:, :-1])  # exact K/V up to the last step, a one-token forward
    layer = cache.layers[0]
    assert layer.codes and layer.prompt_len == out.shape[1] - 2  # what it coded: accepted tokens only


@pytest.mark.slow
def test_chunked_prefill_answers_the_needle_development_split_as_a_whole_one(smollm2):
    """SmolLM2, 2K-token needle prompts of the development split (examples 100-102), the card's one-liner
    (no model=): prefilled in chunks of 256, 512 or 1000 tokens, the same answers and the same footprint."""
    if OLD_CHUNKING:
        pytest.skip("transformers < 5.24 numbers every chunk of a chunked prefill from position 0")
    from evaluation.tasks.needle import needle_examples

    model, tokenizer = smollm2
    for example in needle_examples("niah_single", tokenizer, True, 2048, 3, first=100):
        seg = example.segments
        ids = torch.tensor([seg.context + seg.question + seg.tail])
        answers, fractions = set(), []
        for chunk in (None, 256, 512, 1000):
            cache = VarRateCache.from_pretrained("smollm2-135m-instruct")
            options = {} if chunk is None else {"prefill_chunk_size": chunk}
            out = greedy(model, ids, cache, new=12, **options)
            answers.add(tokenizer.decode(out[0, ids.shape[1]:]))
            fractions.append(cache.footprint().fraction)
        assert len(answers) == 1, f"{example.example_id}: {answers}"
        assert max(fractions) - min(fractions) < 0.01 and max(fractions) < 0.21
