"""How much each layer's coding error moves the model, measured once per model and budget (`layer_budgets="measured"`).

For every compressed layer l, budget b and level s (a multiple of the uniform coefficient budget): code layer l
alone at s * b's coefficients (every other layer exact) and measure how far the next-token distribution on a
probe moves from the full cache's: mean KL(full || coded) over the probe's tokens. The contexts are
calibration text; the probe is a span from the middle of each context, repeated after it, so the model has to
read it back from the cache (what a question about a reused document does). One compressed prefill per context
and level gives every layer's reconstruction; each layer is then swapped alone into the exact cache.

The curves go into the bases' `config.json` (field `layer_sensitivity`), and `codec.layer_budget.measured_scales`
turns them into one scale per layer at run time. Adding them leaves `bases.safetensors` as it was:

    hf-varrate measure-layers my-bases --model smollm2-135m-instruct --budgets 0.1,0.2
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..bases import Bases, read_artifact
from ..bases_checks import ARTIFACT_FILES, CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, check_metadata
from ..binding import bound_as_found, cache_kwarg
from ..cache import VarRateCache
from ..card import render_card
from ..codec.layer_budget import recorded_scales
from ..files import replacing_folder
from .contexts import build_contexts
from .loading import load_model
from .texts import load_texts

LEVELS = (0.5, 1.0, 1.5, 2.0)
PROBE = 128


def measure_sensitivity(model, bases: Bases, contexts: list[torch.Tensor], budgets: list[float], *,
                        levels=LEVELS, probe: int = PROBE, preset: str = "recommended", progress: bool = True,
                        metadata: dict | None = None, **overrides) -> dict:
    """The `layer_sensitivity` field for `bases`: {"levels", "kl": {budget: {layer: [KL per level]}}, ...}
    (`write_measurement` puts it into a bases folder).

    `contexts` are LongTensors of token ids longer than `probe`; the cache codes with `bases.config(preset,
    **overrides)` at each budget, counted in float16 unless `budget_dtype` says otherwise (the bytes of a
    half-precision deployment). `metadata` is recorded beside the curves (e.g. the data's name)."""
    overrides = {"budget_dtype": "float16", **overrides}
    levels = sorted(float(s) for s in levels)
    if 1.0 not in levels or levels[0] <= 0:
        raise ValueError(f"levels must be positive multiples of the uniform budget and include 1.0, got {levels}")
    if any(len(ids) <= probe for ids in contexts) or probe < 1:
        raise ValueError(f"probe must be in [1, context length), got probe={probe} for contexts of "
                         f"{sorted({len(ids) for ids in contexts})} tokens")
    layers = list(bases.metadata["compressed_layers"])
    kl = {float(b): {i: [0.0] * len(levels) for i in layers} for b in budgets}
    started = time.perf_counter()
    for c, ids in enumerate(contexts):
        ids = ids.reshape(-1)
        tokens = ids[len(ids) // 2 : len(ids) // 2 + probe]
        full = _prefill(model, ids, DynamicCache())  # every layer at full length, Gemma's sliding ones too
        exact = {i: (layer.keys, layer.values) for i, layer in enumerate(full.layers)}
        below = []  # each decoder layer's output on the probe with every layer exact
        reference = _read_back(model, exact, tokens, len(ids), record=below)
        for budget in kl:
            config = bases.config(preset, **{**overrides, "budget": budget, "layer_budgets": "uniform"}, stacklevel=3)
            for j, level in enumerate(levels):
                with layers_scaled(bases, lambda i: level), bound_as_found(model):  # the cache sees the queries
                    coded = _prefill(model, ids, VarRateCache(bases, config, model=model)).compress()
                for i in layers:
                    if coded.layers[i].rows_stored_exactly:
                        raise ValueError(
                            f"at budget {budget} x level {level}, layer {i} could not be coded (its exact set plus "
                            f"r_min={config.r_min} per coded token exceed it) and was stored whole, which would read "
                            f"as no error; measure at a higher budget, with longer contexts or with levels >= 1")
                    keys, values = coded.layers[i].read()
                    swapped = {**exact, i: (keys.to(exact[i][0].dtype), values.to(exact[i][1].dtype))}
                    hybrid = _read_back(model, swapped, tokens, len(ids), reuse=(i, below))
                    kl[budget][i][j] += _kl(hybrid, reference) / len(contexts)
                del coded
                if progress:
                    print(f"context {c + 1}/{len(contexts)}, budget {budget}, level {level}: "
                          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    counted = overrides["budget_dtype"] or str(model.dtype).removeprefix("torch.")  # what a lookup converts from
    return {"levels": levels, "probe": probe, "preset": preset, "settings": {**overrides, "budget_dtype": counted},
            "num_contexts": len(contexts), "context_length": int(len(contexts[0])),
            "seconds": round(time.perf_counter() - started, 1), **(metadata or {}),
            "kl": {repr(b): {str(i): [round(x, 6) for x in row] for i, row in curves.items()}
                   for b, curves in kl.items()}}


def write_measurement(folder: str | Path, measured: dict) -> Path:
    """Put `measured` into the bases folder's config.json (field `layer_sensitivity`) and its card, leaving
    bases.safetensors byte for byte (its sha256 in config.json still holds); the folder is replaced as a whole."""
    folder = Path(folder)
    spectrum = bool(read_artifact(folder).spectra)  # verifies the folder first
    meta = json.loads((folder / CONFIG_NAME).read_text())
    meta["layer_sensitivity"] = measured
    check_metadata(meta)
    files = {WEIGHTS_NAME: (folder / WEIGHTS_NAME).read_bytes(),
             CONFIG_NAME: (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode(),
             CARD_NAME: render_card(meta, spectrum=spectrum).encode()}
    with replacing_folder(folder, ARTIFACT_FILES, "bases artifact") as staging:  # all files or none
        for name, data in files.items():
            (staging / name).write_bytes(data)
    read_artifact(folder)  # what was written loads
    return folder


@contextmanager
def layers_scaled(bases: Bases, scale):
    """Code each layer at `scale(layer_idx)` times its uniform coefficient budget while inside."""
    bases.layer_share = lambda layer_idx, config, kv_dtype=None: scale(layer_idx)
    try:
        yield
    finally:
        del bases.layer_share  # the class's method again


def _prefill(model, ids: torch.Tensor, cache):
    """`cache` after a prefill of `ids` (the last position's logits only: all of them would be [S, vocabulary])."""
    with torch.no_grad():
        model(input_ids=ids.view(1, -1).to(model.device), use_cache=True, logits_to_keep=1,
              **{cache_kwarg(model): cache})
    return cache


def _read_back(model, kv: dict, tokens: torch.Tensor, start: int, record: list | None = None,
               reuse: tuple[int, list] | None = None) -> torch.Tensor:
    """Log-probs [P, V] of `tokens` at positions start.. read through a cache holding `kv` ({layer: (K, V)}).

    `record` (a list) receives each decoder layer's output. `reuse` = (i, outputs recorded by a read-back whose
    K/V equal `kv` below layer i): layers below i return those outputs instead of computing them again, since
    their inputs and caches are the same; only layers from i on run (half the layers, on average, of a swap)."""
    cache = DynamicCache(config=model.config)  # the model's own layer kinds (sliding ones keep their window)
    for i in sorted(kv):
        cache.update(*kv[i], i)
    positions = torch.arange(start, start + len(tokens), device=model.device)[None]
    with torch.no_grad(), _decoder_layers_replayed(model, record, reuse):
        logits = model(input_ids=tokens.view(1, -1).to(model.device), position_ids=positions, logits_to_keep=0,
                       **{cache_kwarg(model): cache}).logits
    return F.log_softmax(logits[0].float(), dim=-1)


@contextmanager
def _decoder_layers_replayed(model, record: list | None, reuse: tuple[int, list] | None):
    """While inside, record each decoder layer's output into `record` and / or have the layers below `reuse[0]`
    return `reuse[1]`'s outputs. A model whose decoder layers are not found (`get_decoder().layers`, one per
    cache layer) runs whole, as does a read-back with nothing recorded to reuse."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    text = model.config.get_text_config(decoder=True)
    if layers is None or len(layers) != text.num_hidden_layers or getattr(text, "num_kv_shared_layers", 0):
        layers = []  # (layers reading another layer's cache need every layer's own update)
    hooks = [layer.register_forward_hook(lambda module, args, out: record.append(out)) for layer in layers
             if record is not None]
    skipped = layers[: reuse[0]] if reuse is not None and len(reuse[1]) == len(layers) else []
    saved = [layer.__dict__.get("forward") for layer in skipped]  # accelerate's own wrapper, where dispatched
    for layer, out in zip(skipped, reuse[1] if skipped else []):
        layer.forward = lambda *args, _out=out, **kwargs: _out
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer, forward in zip(skipped, saved):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _kl(coded: torch.Tensor, reference: torch.Tensor) -> float:
    """KL(reference || coded), mean over the probe's tokens."""
    return float(F.kl_div(coded, reference, log_target=True, reduction="batchmean"))


def build_parser(prog: str = "python -m hf_varrate.calibration.sensitivity") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("bases", help="the bases folder to measure and update (its config.json and README.md are rewritten)")
    add("--model", required=True, help="the model the bases are for: a default model name, a local folder or a Hub id")
    add("--revision", default=None, help="Hub revision of --model")
    add("--budgets", default="0.1,0.2", help="comma-separated budgets to measure at (default: 0.1,0.2)")
    add("--levels", default=",".join(str(s) for s in LEVELS), help="multiples of the uniform budget each layer is "
        "tried at (must include 1)")
    add("--num-contexts", type=int, default=4, help="calibration contexts")
    add("--context-length", type=int, default=2048, help="tokens per context (the length the cache will serve)")
    add("--probe", type=int, default=PROBE, help="tokens of each context read back after it")
    add("--preset", default="recommended", help="the preset the cache codes with")
    add("--budget-dtype", default="float16", help="dtype the budgets count bytes in")
    add("--texts", default=None, help="calibration text, as for `hf-varrate calibrate` (default: local Wikipedia "
        "extracts, calibration split)")
    add("--text-field", default="text", help="field holding the text in JSON objects or dataset rows")
    add("--seed", type=int, default=0, help="seed of the document order")
    add("--device", default="cpu", help="torch device to run the model on")
    add("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m hf_varrate.calibration.sensitivity") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    if not (Path(args.bases) / CONFIG_NAME).is_file():
        raise SystemExit(f"{prog}: bases={args.bases!r} is not a bases folder (with {CONFIG_NAME}); pass the folder to "
                         f"measure and update (copy shipped or downloaded bases into one first)")
    args.model_id, args.license = None, None
    model, tokenizer, _ = load_model(args)
    measure_folder(model, tokenizer, args.bases, args, command=f"{prog} " + shlex.join(argv))
    return 0


def measure_folder(model, tokenizer, folder, args, command: str) -> dict:
    """Measure the bases in `folder` on calibration text as `args` say (this command's arguments, or the
    calibration command's), print the scales and write the curves into the folder."""
    texts = load_texts(args.texts, split="calibration", seed=args.seed, text_field=args.text_field)
    contexts = build_contexts(tokenizer, texts.documents, args.num_contexts, args.context_length)
    measured = measure_sensitivity(model, Bases.from_pretrained(folder), contexts,
                                   [float(b) for b in args.budgets.split(",")],
                                   levels=[float(s) for s in args.levels.split(",")], probe=args.probe,
                                   preset=args.preset, budget_dtype=args.budget_dtype, progress=not args.quiet,
                                   metadata={"data": texts.name, "command": command})
    for budget, scales in recorded_scales(measured).items():
        print(f"budget {budget}: per-layer scales {scales}")
    print(f"wrote {write_measurement(folder, measured)}")
    return measured


if __name__ == "__main__":
    sys.exit(main())
