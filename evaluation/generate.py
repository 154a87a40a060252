"""Reading a compressed cache: greedy answers and continuation NLL, as kvpress's pipeline does, and the gold
answer's NLL.

Positions are explicit (the prompt's length, not the cache's: an evicting cache is shorter), the
tail is fed in one forward, then greedy decoding until an EOS token or `max_new_tokens`. Every read
works on a deep copy, so one compressed cache can serve several questions (query-agnostic reuse).

One exception: when an evicting press pruned only some layers (Gemma-3: its global layers, not the
sliding ones), the layers disagree on the cache length, transformers numbers the tail after the
longest, and the pruned layers' causal mask then lets every tail token see the whole tail (the later
tokens included: a perplexity of 2 where the full cache has 13). Such a tail is fed one token at a
time, where a single query has nothing ahead of it to see.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from hf_varrate.binding import attention_modules, cache_kwarg


@contextlib.contextmanager
def installed_masks(model, masks: dict | None):
    """Put kvpress's masked_key_indices on the modules while this cache is read, then remove them."""
    modules = attention_modules(model)
    for module in modules:
        module.masked_key_indices = (masks or {}).get(module.layer_idx)
    try:
        yield
    finally:
        for module in modules:
            module.masked_key_indices = None


def stop_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return {i for i in ids if i is not None}


def greedy_answer(model, tokenizer, cache, masks, tail: list[int], start: int, max_new_tokens: int,
                  copy_cache: bool = True) -> str:
    """Greedy continuation of `tail` placed at position `start`, read from a copy of `cache` (or from `cache`
    itself when `copy_cache` is False: the last read of a cache needs no copy, and quanto's quantized
    tensors cannot be deep-copied)."""
    cache = copy.deepcopy(cache) if copy_cache else cache
    stops = stop_ids(model, tokenizer)
    generated = []
    with torch.no_grad(), installed_masks(model, masks):
        token = int(feed(model, cache, tail, start)[0, -1].argmax())
        position, name = start + len(tail), cache_kwarg(model)
        while True:
            generated.append(token)
            if token in stops or len(generated) >= max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), **{name: cache})
            token, position = int(out.logits[0, -1].argmax()), position + 1
    return tokenizer.decode(generated, skip_special_tokens=True).strip()


def continuation_nll(model, cache, masks, continuation: list[int], start: int,
                     copy_cache: bool = True) -> tuple[float, int]:
    """Sum of NLL of continuation[1:] given the compressed prompt and continuation[:-1]; and the count."""
    cache = copy.deepcopy(cache) if copy_cache else cache
    ids = torch.tensor([continuation])
    with torch.no_grad(), installed_masks(model, masks):
        logits = feed(model, cache, continuation, start, logits_to_keep=0)[0, :-1].float()
    nll = F.cross_entropy(logits, ids[0, 1:], reduction="sum")
    return float(nll), len(continuation) - 1


def answer_nll(model, cache, masks, tail: list[int], answer: list[int], start: int) -> float | None:
    """Mean NLL per token of the gold `answer` fed after `tail` (teacher-forced, positions start..), read from
    a copy of `cache`; None where the cache cannot be copied (quanto's quantized tensors). A graded measure of
    how sure the model still is of the right answer: two caches that both answer right (or both wrong) differ
    here too, so paired comparisons of it resolve smaller differences than the 0/1 match does."""
    if not answer:
        raise ValueError("answer_nll needs the answer's token ids, got none")
    try:
        cache = copy.deepcopy(cache)
    except (TypeError, RuntimeError, NotImplementedError):
        return None
    with torch.no_grad(), installed_masks(model, masks):
        logits = feed(model, cache, tail + answer[:-1], start, logits_to_keep=len(answer))[0].float()  # [A, V]
    return float(F.cross_entropy(logits, torch.tensor(answer), reduction="mean"))


def feed(model, cache, tail: list[int], start: int, logits_to_keep: int = 1) -> torch.Tensor:
    """Logits [1, len(tail) or logits_to_keep, V] of `tail` at positions start.. read through `cache`: one
    forward, or one forward per token where the layers disagree on the cache's length (see above)."""
    positions, name = torch.arange(start, start + len(tail))[None], cache_kwarg(model)
    if len(tail) == 1 or _lengths_agree(cache):
        return model(input_ids=torch.tensor([tail]), position_ids=positions, logits_to_keep=logits_to_keep,
                     **{name: cache}).logits
    logits = [model(input_ids=torch.tensor([[token]]), position_ids=positions[:, i : i + 1], **{name: cache}).logits
              for i, token in enumerate(tail)]
    logits = torch.cat(logits, dim=1)
    return logits if logits_to_keep == 0 else logits[:, -logits_to_keep:]


def _lengths_agree(cache) -> bool:
    layers = getattr(cache, "layers", None)
    if not layers:
        return True
    return len({layer.get_seq_length() for layer in layers if getattr(layer, "is_initialized", True)}) <= 1
