"""Which of a needle's digit tokens an eviction press keeps: `python -m studies.kept_digits`.

Both default models tokenize a number digit by digit, so a 7-digit needle is 7 tokens and an answer
must copy all of them. For the first examples of the single-needle task (query-aware: the question is
inside the compressed prompt), this replays a kvpress press through the evaluation harness and prints, per digit
position of the needle, the share of (full-attention layer, KV head) pairs whose kept keys include
that digit's key.
It is the evidence behind the report's needle-digits table (`needle_digits.csv`): an answer that gets
the first digits right and stops is what a press that keeps the number's start and evicts its end gives.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate.models import DEFAULT_MODELS, load_default_model

from evaluation.capture import capture, full_attention_layers
from evaluation.methods import Context, make_method
from evaluation.run import quiet
from evaluation.tasks import build_examples


def kept_share(original_keys: list[torch.Tensor], cache, layers: list[int], span: slice) -> torch.Tensor:
    """[len(span)]: for each position in `span`, the share of (layer, head) pairs among `layers` whose pruned
    keys hold that position's key (pruning gathers rows, so a kept key equals its original exactly)."""
    kept, pairs = torch.zeros(span.stop - span.start), 0
    for i in layers:
        full, pruned = original_keys[i][0], cache.layers[i].keys[0]  # [H, S, d], [H, kept, d]
        for head in range(full.shape[0]):
            same = (pruned[head][:, None, :] == full[head, span][None]).all(dim=-1)  # [kept, len(span)]
            kept += same.any(dim=0).float()
            pairs += 1
    return kept / pairs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--n", type=int, default=6, help="examples (the first n of the task)")
    parser.add_argument("--press", default="SnapKVPress")
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    model, tokenizer = load_default_model(args.model)
    press = make_method("press", {"kind": "kvpress", "press": args.press, "budget": args.budget})
    chat = DEFAULT_MODELS[args.model].chat_template
    print(f"{args.press} at {args.budget}, {args.model}, {args.length} tokens, query-aware: share of (layer, KV head) "
          f"pairs keeping each digit of the needle")
    for example in build_examples("niah_single", tokenizer, chat, args.length, args.n):
        ids = example.segments.compressed("query_aware")
        captured = capture(model, ids)
        digits = [tokenizer.convert_tokens_to_ids(c) for c in example.answers[0]]
        start = next((i for i in range(len(ids)) if ids[i : i + len(digits)] == digits), None)
        if start is None:
            raise SystemExit(f"{example.example_id}: the needle {example.answers[0]!r} is not one token per digit in "
                             f"{args.model}'s prompt; this diagnostic needs a tokenizer that splits numbers "
                             "into digits")
        compressed = press.compress(Context(model, tokenizer, args.model, captured, ids))
        share = kept_share(captured.keys, compressed.cache, full_attention_layers(model),
                           slice(start, start + len(digits)))
        print(f"{example.example_id} {example.answers[0]}: " + " ".join(f"{s:.2f}" for s in share.tolist()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
