"""The kvpress integration: `VarRatePress` as a kvpress `BasePress` (composition, refusals), and
`VarRateTextGenerationPipeline` giving each question the VarRate-coded document alone.

kvpress is in the `eval` extra (it pins transformers < 5.3, so it lives in .venv-eval): every test
here is skipped where it is not installed.
"""

import warnings

import pytest
import torch
from transformers import DynamicCache

kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed (the eval extra): pip install kvpress")

from hf_varrate import Bases, VarRateCache, VarRateConfig, bound, unbind  # noqa: E402
from hf_varrate.kvpress_pipeline import VarRateTextGenerationPipeline, crop_to  # noqa: E402
from hf_varrate.press import VarRatePress  # noqa: E402

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2)  # lets short prompts compress on D = 64
STORAGES = ["materialized", "compact"]


def tiny_press(model, budget=0.5, **overrides):
    return VarRatePress(Bases.identity(model.config), VarRateConfig(budget=budget, **{**SMALL, **overrides}))


def ids_of(model, length=200, seed=0):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def prefill(model, press, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


# VarRatePress is a kvpress press ------------------------------------------------------------------
def test_varrate_press_is_a_kvpress_base_press_that_evicts_nothing(tiny_llama):
    press = tiny_press(tiny_llama)
    assert isinstance(press, kvpress.BasePress)
    assert press.compression_ratio == 0.0
    with pytest.raises(ValueError, match=r"evicts no tokens.*replace\(budget="):
        press.compression_ratio = 0.5
    with pytest.raises(TypeError, match="config must be a hf_varrate.VarRateConfig"):
        VarRatePress(Bases.identity(tiny_llama.config), {"budget": 0.5})


@pytest.mark.parametrize("overrides", [{}, {"coef_bits": 3, "coef_scales": "component", "signal": "uniform",
                                             "quantized_budget": "same_bytes"}])
def test_the_press_codes_the_prompt_as_a_varrate_cache_does(tiny_llama, overrides):
    ids = ids_of(tiny_llama)
    press = tiny_press(tiny_llama, **overrides)
    cache = prefill(tiny_llama, press, ids)
    exact = prefill(tiny_llama, kvpress.KnormPress(compression_ratio=0.0), ids)
    # the press codes the K/V as the forward computes them; the cache holds them so with hold_dtype="model"
    reference = VarRateCache(press.bases, press.config.replace(storage="materialized", hold_dtype="model"),
                             model=tiny_llama)
    with bound(tiny_llama), torch.no_grad():
        tiny_llama.model(input_ids=ids, past_key_values=reference)
        reference.compress()
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape[2] == ids.shape[1]  # every token kept
        assert not torch.allclose(layer.keys, exact.layers[i].keys)  # ... at a reduced rank
        torch.testing.assert_close(layer.keys, reference.layers[i].keys)
        torch.testing.assert_close(layer.values, reference.layers[i].values)
    assert sum(press.layer_bytes().values()) == reference.footprint().bytes


def test_composed_press_codes_then_evicts_from_the_reconstruction(tiny_llama):
    ids = ids_of(tiny_llama)
    alone = prefill(tiny_llama, tiny_press(tiny_llama), ids)
    composed = kvpress.ComposedPress([tiny_press(tiny_llama), kvpress.KnormPress(compression_ratio=0.5)])
    cache = prefill(tiny_llama, composed, ids)
    assert composed.compression_ratio == pytest.approx(0.5)  # VarRate evicts nothing, Knorm half
    assert set(composed.presses[0].codes) == {0, 1}
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape[2] == ids.shape[1] // 2
        kept = -alone.layers[i].keys.norm(dim=-1)  # Knorm keeps the smallest key norms of the reconstruction
        top = kept.topk(ids.shape[1] // 2, dim=-1).indices.unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
        torch.testing.assert_close(layer.keys, alone.layers[i].keys.gather(2, top))


def test_a_press_that_evicts_before_varrate_is_refused_with_the_order_that_works(tiny_llama):
    composed = kvpress.ComposedPress([kvpress.KnormPress(compression_ratio=0.5), tiny_press(tiny_llama)])
    with pytest.raises(ValueError, match=r"got 100 of the prefill's 200 tokens.*ComposedPress\(\[VarRatePress"):
        prefill(tiny_llama, composed, ids_of(tiny_llama))


def test_key_rerotation_refuses_varrate_which_evicts_nothing_to_rerotate(tiny_llama):
    # kvpress's wrappers take a ScorerPress only (a bare assert): VarRate scores no tokens, keeps them all
    with pytest.raises(AssertionError):
        kvpress.KeyRerotationPress(tiny_press(tiny_llama))


def test_the_press_refuses_a_varrate_cache_which_codes_its_prompt_itself(tiny_llama):
    press = tiny_press(tiny_llama)
    cache = VarRateCache(press.bases, press.config, model=tiny_llama)
    with bound(tiny_llama), press(tiny_llama), torch.no_grad(), pytest.raises(ValueError, match="pass press=None"):
        tiny_llama.model(input_ids=ids_of(tiny_llama), past_key_values=cache)


# the pipeline's removal of each answer -------------------------------------------------------------
@pytest.mark.parametrize("storage", STORAGES)
def test_crop_to_removes_question_and_answer_where_slicing_keys_cannot(tiny_llama, storage):
    config = VarRateConfig(budget=0.5, storage=storage, **SMALL)
    cache = VarRateCache(Bases.identity(tiny_llama.config), config, model=tiny_llama)
    ids = ids_of(tiny_llama)
    with bound(tiny_llama), torch.no_grad():
        tiny_llama.model(input_ids=ids, past_key_values=cache)
        cache.compress()
        document = cache.footprint().bytes
        tiny_llama.model(input_ids=ids_of(tiny_llama, 12, seed=1), past_key_values=cache)  # a question
        for _ in range(3):  # and its answer
            tiny_llama.model(input_ids=ids[:, :1], past_key_values=cache)
    layer = cache.layers[0]
    sliced_keys = layer.keys[:, :, : ids.shape[1]]  # what kvpress's pipeline assigns back
    assert sliced_keys.shape[2] == (15 if storage == "compact" else ids.shape[1])  # compact: the tail alone
    for layer in cache.layers:
        crop_to(layer, ids.shape[1])
        assert layer.get_seq_length() == ids.shape[1] and layer.appended == 0
    assert cache.footprint().bytes == document


def test_the_pipeline_refuses_a_press_with_a_varrate_cache(smollm2):
    model, tokenizer = smollm2
    pipe = VarRateTextGenerationPipeline(model=model, tokenizer=tokenizer)
    press = VarRatePress(Bases.identity(model.config), VarRateConfig(budget=0.5))
    cache = VarRateCache(press.bases, press.config, model=model)
    with pytest.raises(ValueError, match="press=VarRatePress cannot run on a VarRateCache"):
        pipe("Some text.", question="What?", press=press, cache=cache, max_new_tokens=1)


# two questions, each on the document alone (the real default model) --------------------------------
def _essay(tokenizer, n):
    from hf_varrate.demo import essay_text

    return tokenizer.decode(tokenizer(essay_text()[: n * 8], add_special_tokens=False)["input_ids"][:n])


class LengthRecordingPipeline(VarRateTextGenerationPipeline):
    """Records the cache's length after each answer is removed."""

    lengths: list

    def _remove_answer_from_cache(self, cache, cache_seq_lengths):
        super()._remove_answer_from_cache(cache, cache_seq_lengths)
        self.lengths.append([cache.get_seq_length(i) for i in range(len(cache))])


@pytest.mark.parametrize("storage", STORAGES)
def test_two_questions_each_read_the_document_alone(smollm2, storage):
    model, tokenizer = smollm2
    context, questions = _essay(tokenizer, 300), ["What is this text about?", "Who is the author of this text?"]
    pipe = LengthRecordingPipeline(model=model, tokenizer=tokenizer)
    context_length = pipe.preprocess(context, [""], "", 10**6)["context_ids"].shape[1]

    def ask(asked):
        pipe.lengths = []
        cache = VarRateCache.from_pretrained("smollm2-135m-instruct", model=model, budget=0.3, storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answers = pipe(context, questions=asked, cache=cache, max_new_tokens=6)["answers"]
        return answers, cache

    try:
        (first, second), cache = ask(questions)
        assert pipe.lengths == [[context_length] * len(cache)] * 2  # the document alone after each answer
        assert cache.layers[0].appended == 0 and (storage == "materialized") != cache.layers[0].compact
        [alone], _ = ask(questions[1:])  # the second question on a fresh cache with the same document
    finally:
        unbind(model)
    assert second == alone
