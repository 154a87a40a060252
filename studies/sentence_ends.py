"""Sentences without token ids: can the cache find the novelty finder's sentences itself?
`python -m studies.sentence_ends`.

`signal: eval_novelty` (`evaluation.methods.novel_keys`) splits the prompt into sentences on its decoded text, so
it needs the token ids and the tokenizer, which a transformers `Cache` never sees. This asks, on a DEVELOPMENT
split (multi-key needles, examples 100+), what a segmentation the cache could make does instead, by the share of
the four needle sentences' tokens among the 5% most novel segments (the same novelty, `sentence_novelty` over the
full-attention layers' values, and the same choice, `novel_tokens`):

- "sentences": the evaluation's own split (the reference);
- "end tokens": a segment ends after every token whose own text ends a sentence (`END`); what a cache could read
  from layer 0's values, which are a function of the token alone (measured: "layer-0 spread", the largest relative
  distance between two positions' layer-0 values of one token id, over the prompt's first 200 distinct ids), so a
  table of the sentence-ending tokens' layer-0 values (bases-sized) would name the boundaries exactly;
- "blocks B": fixed B-token blocks;
- "change points (values|keys) M": a boundary at the S / M positions least similar to their predecessor (cosine
  of the adjacent tokens' values or keys, summed over the full-attention layers).

"boundary agreement" is the share of positions where "end tokens" and "sentences" agree on whether a segment starts.

    python -m studies.sentence_ends --model gemma-3-270m --length 4096 --n 10

A diagnostic, not a result: nothing is chosen on it. Its tables are in docs/results/sentence_ends/.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import torch

from evaluation.capture import capture, full_attention_layers
from evaluation.methods.novel_keys import heads_side_by_side, novel_tokens, sentence_novelty, sentence_of
from evaluation.run import quiet
from evaluation.tasks import build_examples
from hf_varrate.models import DEFAULT_MODELS, load_default_model

from .needle_attention import ASKED_PATTERN, GROUPS, token_groups

END = re.compile(r"[.!?]+[\"')\]]*\s*$|\n")  # a token whose own text ends a sentence
SHARE = 0.05  # of the prompt's tokens, in the most novel segments
SPREAD_IDS = 200  # distinct token ids whose layer-0 values are compared across positions


def starts(ends: torch.Tensor) -> torch.Tensor:
    """[S] segment index from [S] bool 'a segment ends after this position'."""
    return torch.cat([ends.new_zeros(1, dtype=torch.long), ends[:-1].long().cumsum(0)])


def change_points(states: dict[int, torch.Tensor], mean_length: int) -> torch.Tensor:
    """[S] segment index: boundaries at the S // mean_length positions least like their predecessor."""
    length = next(iter(states.values())).shape[-2]
    similar = torch.zeros(length)
    for layer in states.values():
        flat = heads_side_by_side(layer)
        similar[1:] += torch.nn.functional.cosine_similarity(flat[1:], flat[:-1], dim=1)
    similar[0] = float("inf")
    cut = torch.zeros(length, dtype=torch.long)
    cut[similar.topk(max(1, length // mean_length), largest=False).indices] = 1
    cut[0] = 0
    return cut.cumsum(0)


def layer0_spread(values: torch.Tensor, ids: torch.Tensor) -> float:
    """The largest relative distance between two positions' layer-0 values ([1, H, S, d]) of one token id."""
    flat = heads_side_by_side(values)
    spread = 0.0
    for token in ids.unique()[:SPREAD_IDS]:
        rows = flat[ids == token]
        spread = max(spread, float((rows - rows[0]).norm(dim=1).max() / rows[0].norm().clamp_min(1e-6)))
    return spread


def screen(model, tokenizer, example) -> dict[str, float]:
    """{segmentation: needle share of its most novel segments}, the boundary agreement and the layer-0 spread, for
    one multi-key example's document (captured alone, as under reuse)."""
    seg = example.segments
    captured = capture(model, seg.context)
    layers = full_attention_layers(model)
    values = {i: captured.values[i] for i in layers}
    keys = {i: captured.keys[i] for i in layers}
    groups = token_groups(tokenizer, seg.context, ASKED_PATTERN.search(tokenizer.decode(seg.tail)).group(1))
    needles = torch.cat([groups[g] for g in GROUPS[:6]])
    ends = torch.tensor([bool(END.search(tokenizer.decode([t]))) for t in seg.context])
    segments = {"sentences": sentence_of(tokenizer, seg.context), "end tokens": starts(ends)}
    segments |= {f"blocks {b}": torch.arange(len(seg.context)) // b for b in (8, 16, 32)}
    for which, states in (("values", values), ("keys", keys)):
        segments |= {f"change points ({which}) {m}": change_points(states, m) for m in (12, 20, 32)}
    found = {name: float(torch.isin(needles, novel_tokens(sentence_novelty(values, s), s, SHARE)).float().mean())
             for name, s in segments.items()}
    found["boundary agreement"] = float(((segments["end tokens"].diff() != 0)
                                         == (segments["sentences"].diff() != 0)).float().mean())
    found["layer-0 spread"] = layer0_spread(captured.values[0], torch.tensor(seg.context))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--first", type=int, default=100, help="first example (100+: development split)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="folder for summary.md")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(args.model)
    chat = DEFAULT_MODELS[args.model].chat_template
    rows = [screen(model, tokenizer, example) for example in
            build_examples("niah_multikey", tokenizer, chat, args.length, args.n, first=args.first)]
    command = "python -m studies.sentence_ends " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [f"# {args.model}, niah_multikey at {args.length}, examples {args.first}-{args.first + args.n - 1}",
             "", f"`{command}`; needle tokens among the {SHARE:.0%} most novel segments, mean over examples", "",
             "| segmentation | needle share |", "|---|---|"]
    lines += [f"| {name} | {sum(r[name] for r in rows) / len(rows):.3f} |" for name in rows[0]
              if name not in ("boundary agreement", "layer-0 spread")]
    agreement = sum(r["boundary agreement"] for r in rows) / len(rows)
    lines += ["", f"boundary agreement (end tokens vs sentences): {agreement:.3f}; "
              f"layer-0 spread (max): {max(r['layer-0 spread'] for r in rows):.2e}", ""]
    summary = "\n".join(lines)
    print(summary)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.md").write_text(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
