"""Peers from kvpress, run through kvpress's own code: SnapKV, Expected Attention, KVzip, ...

A scorer press is replayed by calling its own `forward_hook` per full-attention layer with the
kwargs the attention module would pass, inside `with press(model):` (kvpress's own setup:
post_init_from_model, rotary embedding). Gemma-3's sliding layers are left alone, as VarRate leaves
them. KVzip re-reads the context with the full model: we enter its context manager, hand it the
context ids and the uncompressed cache its wrapped forward would have recorded, and it runs its
reconstruction passes and masks the evicted entries (masked_key_indices, kvpress's simulated
eviction); the masks are moved off the modules and re-installed only while this cache is read.
`budget` is the fraction kept: compression_ratio = 1 - budget. `pin_last` gives KVzip the paper's
64-token pin of the prompt's tail (the pin decides which entries are dropped, never how many).

KVzip's scores do not depend on the budget (its reconstruction passes score every entry; the budget
only sets how many of the lowest are masked, in `compress_post`). So when KVzip runs on the same
prompt at another budget right after (one stage's kvzip@0.1 and kvzip@0.3), its passes are not run
again: the scores are reused, and the row's cost is the scoring run's CPU time plus this run's own
(row field `kvzip_scores_reused`). The masks equal a fresh run's (tests/test_evaluation.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile

import torch

from hf_varrate.binding import attention_modules

from ..capture import clock, is_sliding
from .base import Compressed, Context, Unsupported, dynamic_from_capture


def press_class(name: str):
    import kvpress

    if name == "KVzipPress":
        return pinned_kvzip_class()
    if not hasattr(kvpress, name):
        raise ValueError(f"press must name a kvpress press class (e.g. SnapKVPress), got {name!r}")
    return getattr(kvpress, name)


@functools.lru_cache(maxsize=1)
def pinned_kvzip_class():
    from kvpress import KVzipPress

    class PinnedKVzipPress(KVzipPress):
        pin_last: int = 0
        saved_scores = None  # set: skip the scoring passes and mask by these scores (same prompt, other budget)
        scores_seen = None  # after a run: its scores before the sink and tail pins, for `saved_scores`

        def _perform_kvzip_compression(self, model, tokenizer):
            if self.saved_scores is None:
                return super()._perform_kvzip_compression(model, tokenizer)
            self.context_length = self._context_ids.shape[1]
            self.score_val = self.saved_scores.clone()
            self.compress_post(model)

        def compress_post(self, model):
            self.scores_seen = self.score_val.clone()
            if self.compression_ratio > 0 and self.pin_last:
                self.score_val[..., -self.pin_last :] = self.score_val.amax() + 1.0
            super().compress_post(model)

    return PinnedKVzipPress


class KVPressMethod:
    kind = "kvpress"

    def __init__(self, name: str, spec: dict):
        self.name, self.spec = name, spec
        self.press_name = spec["press"]
        self.options = dict(spec.get("options", {}))

    def make_press(self):
        cls = press_class(self.press_name)
        press = cls(compression_ratio=round(1.0 - float(self.spec["budget"]), 6), **self.options)
        if self.press_name == "KVzipPress":
            press.pin_last = int(self.spec.get("pin_last", 0))
        return press

    def compress(self, ctx: Context) -> Compressed:
        press = self.make_press()
        start = clock()
        cache = dynamic_from_capture(ctx.model, ctx.captured)
        if self.press_name == "KVzipPress":
            key = (id(ctx.model), tuple(ctx.ids))
            reused = KVZIP_SCORES.get(key)  # (scores, CPU seconds) of this prompt's scoring at another budget
            press.saved_scores = None if reused is None else reused[0]
            masks = replay_kvzip(press, ctx, cache)
            seconds = clock() - start
            if reused is None:
                KVZIP_SCORES.clear()  # one prompt at a time: the runner finishes an example before the next
                if press.scores_seen is not None:  # None: budget 1.0, nothing was scored
                    KVZIP_SCORES[key] = (press.scores_seen, seconds)
            else:
                seconds += reused[1]
            return Compressed(cache, seconds, masks=masks, extra={"kvzip_scores_reused": reused is not None})
        replay_press(press, ctx, cache)
        return Compressed(cache, clock() - start)


KVZIP_SCORES: dict = {}  # (id(model), prompt ids) -> (KVzip's scores, CPU seconds of the run that computed them)


def replay_press(press, ctx: Context, cache):
    """Call `press.forward_hook` per full-attention layer as a live prefill would; returns `cache`."""
    cap, length = ctx.captured, ctx.captured.length
    with torch.no_grad(), press(ctx.model), layer_typed_rotary(ctx.model):
        for module in attention_modules(ctx.model):
            i = module.layer_idx
            if is_sliding(ctx.model, i):
                continue
            kwargs = {"hidden_states": cap.hidden[i], "past_key_values": cache, "attention_mask": None,
                      "cache_position": torch.arange(length), "position_embeddings": (cap.cos[i], cap.sin[i])}
            press.forward_hook(module, [], kwargs, (None, None))
    return cache


class _LayerTypedRotary(torch.nn.Module):
    """`rotary(x, position_ids)` for a model whose rotary embedding also wants the layer's type."""

    def __init__(self, rotary, layer_type: str):
        super().__init__()
        self.rotary, self.layer_type = rotary, layer_type

    def forward(self, x, position_ids):
        return self.rotary(x, position_ids, layer_type=self.layer_type)


@contextlib.contextmanager
def layer_typed_rotary(model):
    """Compatibility shim, not a change of method: kvpress 0.5.5 presses (Expected Attention) call
    `module.rotary_emb(x, position_ids)`, but transformers 5.2's Gemma-3 rotary embedding needs
    `layer_type=` (else: no attribute 'None_inv_freq'). Pass each module its own layer type."""
    modules = [m for m in attention_modules(model) if getattr(m, "layer_type", None) is not None
               and hasattr(m, "rotary_emb") and "layer_type" in inspect.signature(m.rotary_emb.forward).parameters]
    originals = [m.rotary_emb for m in modules]
    for module in modules:
        module.rotary_emb = _LayerTypedRotary(module.rotary_emb, module.layer_type)
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.rotary_emb = original


def replay_kvzip(press, ctx: Context, cache) -> dict:
    """Run KVzip's scoring passes on `cache`; return and clear the masks it leaves on the modules."""
    modules = attention_modules(ctx.model)
    try:
        with torch.no_grad(), local_name_or_path(ctx.model, ctx.tokenizer), press(ctx.model):
            press._context_ids = torch.tensor([ctx.ids])  # what its wrapped forward records
            press._cache = cache
    except ValueError as err:  # e.g. "KVzipPress is not supported for Gemma3ForCausalLM"
        raise Unsupported(str(err)) from err
    masks = {m.layer_idx: getattr(m, "masked_key_indices", None) for m in modules}
    clear_masks(ctx.model)
    return masks


_TOKENIZER_FOLDERS: list[tempfile.TemporaryDirectory] = []  # removed when the process exits


@functools.lru_cache(maxsize=4)
def saved_tokenizer(tokenizer) -> str:
    """A temporary folder holding `tokenizer` (one per tokenizer; removed when the process exits)."""
    folder = tempfile.TemporaryDirectory(prefix="evaluation-tokenizer-")
    _TOKENIZER_FOLDERS.append(folder)
    tokenizer.save_pretrained(folder.name)
    return folder.name


@contextlib.contextmanager
def local_name_or_path(model, tokenizer):
    """KVzip reloads the tokenizer from model.config.name_or_path; our models are named by their Hub id
    (offline here), so point it at a local copy of the same tokenizer while it runs."""
    original = model.config._name_or_path
    model.config._name_or_path = saved_tokenizer(tokenizer)
    try:
        yield
    finally:
        model.config._name_or_path = original


def clear_masks(model):
    for module in attention_modules(model):
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None
