"""`VarRateTextGenerationPipeline`: kvpress's question-answering pipeline, for a `VarRateCache`.

    from transformers import pipeline
    from hf_varrate import VarRateCache
    from hf_varrate.kvpress_pipeline import VarRateTextGenerationPipeline
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer,
                    pipeline_class=VarRateTextGenerationPipeline)
    cache = VarRateCache.from_pretrained("smollm2-135m-instruct", model=model, storage="compact", budget=0.2)
    pipe(context, questions=[first, second], cache=cache)

kvpress's pipeline prefills the document into the cache, then for each question generates an answer
and removes the question and answer by slicing every layer's `.keys` / `.values` back to the
document's length. A VarRateCache needs two things that pipeline does not do:

- the document coded alone: `cache.compress()` before the first question (a VarRateCache codes what
  arrives before decoding as one prompt, so the first question would be coded with the document and
  decide its ranks);
- the question and answer removed with `crop`: a compact layer holds only the tokens after the prompt
  in `.keys`, so slicing it removes nothing (with kvpress's own pipeline the first answer stays in the
  cache and the second question reads it), and a materialized layer sliced behind its back keeps
  counting the removed tokens.

This subclass does both and leaves every other cache to kvpress. In compact storage the cache holds
only codes and exact tokens: the memory VarRatePress, which writes K/V tensors into a DynamicCache,
cannot save. A press is refused with a VarRateCache (a press writes K/V tensors into the layers, which
code their prompt themselves). Needs kvpress (the `eval` extra).
"""

from __future__ import annotations

from .cache import VarRateCache
from .layers import VarRateLayer

try:  # the optional `eval` extra
    from kvpress.pipeline import KVPressTextGenerationPipeline
except ImportError as err:
    raise ImportError("hf_varrate.kvpress_pipeline extends kvpress's pipeline and needs kvpress: pip install kvpress "
                      "(or pip install 'hf_varrate[eval]')") from err

__all__ = ["VarRateTextGenerationPipeline", "crop_to"]


class VarRateTextGenerationPipeline(KVPressTextGenerationPipeline):
    """kvpress's `kv-press-text-generation` pipeline that gives each question the VarRate-coded document alone."""

    def _forward(self, input_tensors, max_new_tokens: int = 50, press=None, cache=None):
        if isinstance(cache, VarRateCache) and press is not None:
            raise ValueError(
                f"press={type(press).__name__} cannot run on a VarRateCache: a kvpress press writes K/V tensors into "
                f"the cache's layers, which code their prompt themselves. Pass press=None with a VarRateCache, or "
                f"the press with cache=None (a DynamicCache)")
        return super()._forward(input_tensors, max_new_tokens=max_new_tokens, press=press, cache=cache)

    def generate_answer(self, question_ids, cache, context_length: int, max_new_tokens: int) -> str:
        if isinstance(cache, VarRateCache):
            cache.compress()  # the document ends here: coded alone, before (and without) any question
        return super().generate_answer(question_ids, cache, context_length, max_new_tokens)

    def _remove_answer_from_cache(self, cache, cache_seq_lengths: list[int]) -> None:
        if isinstance(cache, VarRateCache):
            for layer, length in zip(cache.layers, cache_seq_lengths):
                if isinstance(layer, VarRateLayer):
                    crop_to(layer, length)
        super()._remove_answer_from_cache(cache, cache_seq_lengths)  # the other layers, kvpress's way


def crop_to(layer: VarRateLayer, length: int) -> None:
    """Crop `layer` back to its first `length` tokens. A negative crop removes that many tokens under every
    transformers version (before 5.24 `crop` also takes a length, and `crop(0)` empties the layer)."""
    removed = layer.get_seq_length() - length
    if removed > 0:
        layer.crop(-removed)
