"""Needles: what the codes lose where a key is bound to its value. `python -m studies.needle_attention`.

`needle_confusions` showed that the `recommended` preset's wrong multi-key answers on Gemma-3 are
mostly another planted needle's value: the number survives, the binding to its key does not. This
asks where, on a DEVELOPMENT split (examples 100+ by default: the full evaluation reports 0-49 and
the preset's held-out splits use 200+), query-agnostic (the document compressed alone):

1. the coding error by token group, in the full-attention layers: relative error of the keys and
   values of each needle sentence's key words ("{key}"), value digits and other words, the asked
   needle's apart from the three others', and of the haystack; each group's share of tokens stored
   exactly (anchors, the window) and the mean rank of its coded ones;
2. attention at the token that predicts the answer's first digit, with the queries of the
   uncompressed run (so only the prompt's keys differ): the mass on the asked needle's sentence and
   on the other three, per full-attention layer, averaged over query heads;
3. counterfactual answers: the compressed cache with one group's keys or values put back exact
   (everything else still coded), answered greedily as the runner does, each counted against the
   codes as they are and against the full cache in paired flips (+: examples it gets right that the
   other does not; -: the reverse), and the right answer's teacher-forced NLL beside the full cache's (the
   evaluation's `answer_nll`, signed as its report signs it: positive, surer than the full cache), which moves
   where no answer flips. A group whose exact keys move the answers is where the binding is lost.

    python -m studies.needle_attention --n 40 --out studies/runs/needle_attention/gemma-3-270m-L4096-dev

`--set FIELD=VALUE` changes the method's spec (e.g. `--set signal=residual`: does a rank signal find
the needle sentences?) and `--variants` picks the counterfactuals (the codes and the full cache always run).

`--task niah_single` asks the same of single needles (one needle, so no "other" groups), and both tasks' tables
add where in the document the error is (the prompt cut into tenths) and the answers by the asked needle's depth:
do the codes lose early needles, and is it the needle's own code or the haystack between it and the question?

    python -m studies.needle_attention --model smollm2-135m-instruct --task niah_single --n 40

A diagnostic, not a result: nothing is chosen on it, and it runs outside the evaluation's examples.
The tables of the runs the README cites are in docs/results/needle_attention/.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import shlex
import sys
from pathlib import Path

import torch
import yaml

from evaluation.capture import capture, full_attention_layers
from evaluation.config import REPO, load_config
from evaluation.generate import answer_nll, greedy_answer
from evaluation.methods import Context, make_method
from evaluation.methods.base import dynamic_from_capture
from evaluation.methods.novel_keys import most_novel_shares
from evaluation.methods.novel_keys import token_offsets
from evaluation.methods.read_keys import attention_read, most_read
from evaluation.prompts import encode
from evaluation.run import quiet
from evaluation.tasks import build_examples
from evaluation.tasks.needle import ANSWER_PREFIX
from hf_varrate.binding import attention_modules, window_queries
from hf_varrate.models import DEFAULT_MODELS, load_default_model

from .needle_confusions import KINDS, NEEDLE_PATTERN, classify, planted, template_pattern
from .needle_depths import by_fifth, interval

TASKS = ("niah_multikey", "niah_single")
EXACT = 2e-3  # a relative error below this is a token stored exactly (rounded to the cache's dtype), not coded
TENTHS = 10  # the prompt is cut into this many equal spans for the error-by-position table
PARTS = ("key words", "value", "rest")  # of a needle sentence: its "{key}", its "{value}", its other words
ASKED_PATTERN = template_pattern(ANSWER_PREFIX, key=r"(\S+)")  # the asked key, in the tail's answer prefix
GROUPS = (*(f"{who} {part}" for who in ("asked", "other") for part in PARTS), "haystack")
NEEDLES = {"asked needle": GROUPS[:3], "other needles": GROUPS[3:6]}
# (variant, what is put back exact, on which groups); "codes": nothing, the compressed cache as it is
VARIANTS = {
    "codes": (None, ()),
    "exact keys: needles": ("keys", GROUPS[:6]),
    "exact keys: key words": ("keys", ("asked key words", "other key words")),
    "exact keys: values": ("keys", ("asked value", "other value")),
    "exact values: needles": ("values", GROUPS[:6]),
    "exact keys: haystack": ("keys", ("haystack",)),
    "exact keys: all": ("keys", GROUPS),
    "exact values: all": ("values", GROUPS),
    "halved key error: needles": ("halved key error", GROUPS[:6]),
    "quartered key error: needles": ("quartered key error", GROUPS[:6]),
    "key norms: needles": ("key norms", GROUPS[:6]),
    "key norms: all": ("key norms", GROUPS),
}
SHRUNK_ERROR = {"halved key error": 0.5, "quartered key error": 0.25}  # the share of the key's error left
# Keys the codes err on most, per layer (the largest ||coded - exact|| over the heads, among all prompt tokens): a
# query-agnostic choice a codec could make at the prefill, where it holds the exact keys (dense-and-sparse, as
# KVQuant keeps outliers). Unpaid here, like every variant: it asks whether such a choice finds the needles.
WORST = {"exact keys: worst 2%": 0.02, "exact keys: worst 5%": 0.05}
VARIANTS |= {name: ("keys", ()) for name in WORST}  # positions chosen per layer by `worst_keys`
# Keys the document's own queries read most (H2O's heavy hitters, from every 16th query of the prompt rather than
# SnapKV's tail window, `evaluation.methods.read_keys`), per layer: query-agnostic, at the cost of more attention.
ATTENDED = {"exact keys: most read 1%": 0.01, "exact keys: most read 2%": 0.02}
VARIANTS |= {name: ("keys", ()) for name in ATTENDED}  # positions chosen per layer by `most_read`
RANDOM = {"exact keys: random 2%": 0.02}  # the control: as many keys, chosen by no signal (seeded per layer)
VARIANTS |= {name: ("keys", ()) for name in RANDOM}
# The sentences that differ most from their neighbours in their values (`evaluation.methods.novel_keys`), whole,
# the same for every layer: a query-agnostic choice from the prompt's own token ids and values.
NOVEL = {"exact keys: novel sentences 2%": 0.02, "exact keys: novel sentences 5%": 0.05}
VARIANTS |= {name: ("keys", ()) for name in NOVEL}


def token_groups(tokenizer, ids: list[int], asked: str) -> dict[str, torch.Tensor]:
    """{group: LongTensor of positions in `ids`} for a multi-key prompt whose asked key is `asked`.

    The prompt's text is decoded and re-encoded with offsets (`novel_keys.token_offsets`: a tokenizer that does
    not give back the same ids is refused rather than mapped approximately)."""
    text, offsets = token_offsets(tokenizer, ids)
    spans = collections.defaultdict(list)  # group -> character spans
    for match in NEEDLE_PATTERN.finditer(text):
        who = "asked" if match.group(1) == asked else "other"
        spans[f"{who} key words"].append(match.span(1))
        spans[f"{who} value"].append(match.span(2))
        spans[f"{who} rest"].append(match.span())
    if len(spans["asked key words"]) != 1 or len(ids) < TENTHS:
        raise ValueError(f"the asked key {asked!r} is in {len(spans['asked key words'])} needles of the "
                         f"{len(ids)}-token prompt, not 1 (or the prompt is shorter than {TENTHS} tokens)")
    group_of = ["haystack"] * len(ids)
    for position, (start, stop) in enumerate(offsets):
        for group in GROUPS[:6]:  # first match wins: a key word is not also "rest"
            if any(start < b and a < stop for a, b in spans[group]):
                group_of[position] = group
                break
    return {g: torch.tensor([i for i, h in enumerate(group_of) if h == g], dtype=torch.long) for g in GROUPS}


def ranks_at(code, positions: torch.Tensor, length: int) -> torch.Tensor | None:
    """The ranks of the coded tokens among `positions` ([k] float); None where the layer stored its prompt exactly."""
    if code.stored_exactly:
        return None
    coded = torch.zeros(length, dtype=torch.bool)
    coded[positions] = True
    return code.ranks.float()[coded[code.coded_pos]]


def norm_ratio(exact: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """[S]: per token, the mean over heads of ||coded|| / ||exact|| ([H, S, d] each): below 1, the codes shrink it."""
    return (coded.norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)).mean(dim=0)


def relative_error(exact: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """[S]: per token, ||coded - exact|| / ||exact|| over the heads' dims ([H, S, d] each)."""
    return (coded - exact).norm(dim=(0, 2)) / exact.norm(dim=(0, 2)).clamp_min(1e-12)


def answer_attention(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """[Hq, S]: softmax attention of one query per head [Hq, d] over keys [H, S, d] (grouped heads)."""
    keys = keys.repeat_interleave(query.shape[0] // keys.shape[0], dim=0)
    return torch.softmax(torch.einsum("hd,hsd->hs", query.float(), keys.float()) * scaling, dim=-1)


def put_back(cache, exact, layers: list[int], which: str, positions: torch.Tensor):
    """A copy of a materialized VarRate cache with `which` ('keys' / 'values') at `positions` exact again,
    ('key norms') each of those keys, per head, scaled to its exact key's norm (the direction still the code's), or
    ('halved key error' / 'quartered key error') moved that far toward the exact key: how much more precision the
    needles' keys need, short of exact."""
    patched = copy.deepcopy(cache)
    for i in layers:
        layer, rows = patched.layers[i], positions[i] if isinstance(positions, dict) else positions
        if which == "key norms":
            coded = layer.keys[:, :, rows].float()
            scale = exact[i][:, :, rows].float().norm(dim=-1, keepdim=True) / coded.norm(dim=-1, keepdim=True)
            layer.keys[:, :, rows] = (coded * scale.nan_to_num(1.0, 1.0, 1.0)).to(layer.keys.dtype)
            continue
        if which in SHRUNK_ERROR:
            coded = layer.keys[:, :, rows].float()
            kept = SHRUNK_ERROR[which]
            layer.keys[:, :, rows] = (exact[i][:, :, rows].float() * (1 - kept) + coded * kept).to(layer.keys.dtype)
            continue
        getattr(layer, which)[:, :, rows] = exact[i][:, :, rows].to(getattr(layer, which).dtype)
    return patched


def worst_keys(context, cache, layers: list[int], share: float) -> dict[int, torch.Tensor]:
    """{layer: the round(share * length) prompt positions whose coded keys are farthest from the exact ones}."""
    count = max(1, round(share * context.length))
    worst = {}
    for i in layers:
        error = (cache.layers[i].keys[0, :, : context.length].float() - context.keys[i][0].float()).norm(dim=(0, 2))
        worst[i] = error.topk(count).indices.sort().values
    return worst


def diagnose(model, tokenizer, model_name: str, example, method, variants=tuple(VARIANTS)) -> dict:
    """Group errors and ranks, errors by position, attention masses and counterfactual answers (`variants`) of one
    needle example."""
    seg = example.segments
    captured = capture(model, seg.context + seg.question + seg.tail)
    context = captured.prefix(len(seg.context))
    cache = method.compress(Context(model, tokenizer, model_name, context, seg.context)).cache
    layers = full_attention_layers(model)
    asked = ASKED_PATTERN.search(tokenizer.decode(seg.tail)).group(1)
    groups = token_groups(tokenizer, seg.context, asked)
    found = {"depth": example.meta["depth"], **group_errors(context, cache, layers, groups),
             **worst_shares(context, cache, layers, groups),
             **position_errors(context, cache, layers), **answer_masses(model, captured, context, cache, groups)}
    read = None
    if any(v in ATTENDED for v in variants):
        read = attention_read(model, context, layers)
        found |= read_shares(most_read(read, max(ATTENDED.values())), groups)
    novel = None
    if any(v in NOVEL for v in variants):
        rows = most_novel_shares(tokenizer, seg.context, context, layers, list(NOVEL.values()))
        novel = {share: {i: positions for i in layers} for share, positions in rows.items()}
        found |= read_shares(novel[max(NOVEL.values())], groups, "most novel")
    answers, found["answer nll"] = counterfactual_answers(model, tokenizer, example, context, cache, groups, variants,
                                                          read, novel)
    values = planted(tokenizer.decode(seg.context))
    found["answers"] = {k: classify(v, example.answers[0], values) for k, v in answers.items()}
    found["predictions"] = answers
    return found


def group_errors(context, cache, layers: list[int], groups: dict) -> dict:
    """Per token group: key and value relative errors, the share of keys stored exactly, the coded tokens' mean rank."""
    found = {f"tokens: {group}": len(where) for group, where in groups.items()}
    for kind, exact in (("key", context.keys), ("value", context.values)):
        coded = {i: getattr(cache.layers[i], kind + "s")[0, :, : context.length] for i in layers}
        for group, where in groups.items():
            if not len(where):  # a single needle has no "other" groups
                continue
            errors = torch.stack([relative_error(exact[i][0][:, where], coded[i][:, where]) for i in layers])
            found[f"{kind} error: {group}"] = float(errors.mean())
            if kind == "key":
                found[f"exact share: {group}"] = float((errors < EXACT).float().mean())
                ratios = torch.stack([norm_ratio(exact[i][0][:, where], coded[i][:, where]) for i in layers])
                found[f"key norm ratio: {group}"] = float(ratios[errors >= EXACT].mean()) if (errors >= EXACT).any() \
                    else None
    for group, where in groups.items():  # the rank each layer's codes gave the group's coded tokens
        if not len(where):
            continue
        ranks = [ranks_at(cache.layers[i].codes[0], where, context.length) for i in layers]
        ranks = torch.cat([r for r in ranks if r is not None] or [torch.zeros(0)])
        found[f"mean rank: {group}"] = float(ranks.mean()) if ranks.numel() else None
    return found


def worst_shares(context, cache, layers: list[int], groups: dict) -> dict:
    """Per token group, the share of its tokens among each layer's worst keys (`worst_keys`, the smallest share of
    WORST), mean over `layers`: does the codec's own error find the needles?"""
    share = min(WORST.values())
    chosen = worst_keys(context, cache, layers, share)
    found = {}
    for group, where in groups.items():
        if len(where):
            found[f"in worst {share:.0%}: {group}"] = sum(float(torch.isin(where, chosen[i]).float().mean())
                                                         for i in layers) / len(layers)
    return found


def random_keys(length: int, layers: list[int], share: float) -> dict[int, torch.Tensor]:
    """{layer: round(share * length) positions drawn without replacement (seed: the layer), the first token out}."""
    count = max(1, round(share * length))
    return {i: (1 + torch.randperm(length - 1, generator=torch.Generator().manual_seed(i))[:count]).sort().values
            for i in layers}


def read_shares(chosen: dict[int, torch.Tensor], groups: dict, label: str = "most read") -> dict:
    """Per token group, the share of its tokens among each layer's chosen keys (`most_read` at the largest share
    of ATTENDED, or the most novel sentences at the largest of NOVEL), mean over layers."""
    return {f"{label}: {group}": sum(float(torch.isin(where, rows).float().mean()) for rows in chosen.values())
            / len(chosen) for group, where in groups.items() if len(where)}


def position_errors(context, cache, layers: list[int]) -> dict:
    """Per tenth of the prompt (its first tokens in tenth 0): key and value relative errors and the share of keys
    stored exactly (relative error below EXACT), over `layers`."""
    found = {}
    tenths = torch.arange(context.length) * TENTHS // context.length
    for kind, exact in (("key", context.keys), ("value", context.values)):
        errors = torch.stack([relative_error(exact[i][0], getattr(cache.layers[i], kind + "s")[0, :, : context.length])
                              for i in layers])
        for t in range(TENTHS):
            found[f"{kind} error: tenth {t}"] = float(errors[:, tenths == t].mean())
            if kind == "key":
                found[f"exact share: tenth {t}"] = float((errors[:, tenths == t] < EXACT).float().mean())
    return found


def answer_masses(model, captured, context, cache, groups: dict) -> dict:
    """Per full-attention layer: attention mass of the answer-predicting query on the asked and other needles,
    over the exact prompt keys and over the coded ones (the tail's keys exact in both)."""
    found = {}
    modules = {m.layer_idx: m for m in attention_modules(model)}
    for i in full_attention_layers(model):
        query = window_queries(modules[i], captured.hidden[i], captured.cos[i], captured.sin[i], 1)[0, :, 0]
        tail_keys = captured.keys[i][0, :, context.length :]
        coded_keys = cache.layers[i].keys[0, :, : context.length]
        for name, prompt_keys in (("full", context.keys[i][0]), ("codes", coded_keys)):
            weights = answer_attention(query, torch.cat([prompt_keys, tail_keys], dim=1), modules[i].scaling)
            for needle, parts in NEEDLES.items():
                where = torch.cat([groups[g] for g in parts])
                if not len(where):
                    continue
                found[f"attention {name} L{i}: {needle}"] = float(weights[:, where].sum(dim=1).mean())
    return found


def counterfactual_answers(model, tokenizer, example, context, cache, groups: dict, variants,
                           read: dict | None = None, novel: dict | None = None) -> tuple[dict, dict]:
    """({variant: greedy answer}, {variant: the right answer's mean NLL an answer token, teacher-forced}) from the
    full cache and from the codes with each variant's groups put back exact; the NLL is the graded measure the
    runner's `answer_nll` is, so a variant that moves no answer can still be seen to move the model's certainty."""
    seg, layers = example.segments, full_attention_layers(model)
    fed, start, new = seg.fed_after("query_agnostic"), len(seg.context), example.max_new_tokens
    right = encode(tokenizer, " " + example.answers[0])
    full = dynamic_from_capture(model, context)
    nlls = {"full": answer_nll(model, full, None, fed, right, start)}
    answers = {"full": greedy_answer(model, tokenizer, full, None, fed, start, new, copy_cache=False)}
    for variant in variants:
        which, names = VARIANTS[variant]
        variant_cache = cache
        if which is not None:
            positions = (worst_keys(context, cache, layers, WORST[variant]) if variant in WORST
                         else most_read(read, ATTENDED[variant]) if variant in ATTENDED
                         else random_keys(context.length, layers, RANDOM[variant]) if variant in RANDOM
                         else novel[NOVEL[variant]] if variant in NOVEL
                         else torch.cat([groups[g] for g in names]))
            exact = context.values if which == "values" else context.keys
            variant_cache = put_back(cache, exact, layers, which, positions)
        nlls[variant] = answer_nll(model, variant_cache, None, fed, right, start)
        answers[variant] = greedy_answer(model, tokenizer, variant_cache, None, fed, start, new)
    return answers, nlls


def summarize(results: list[dict], layers: list[int]) -> str:
    """Markdown: per-group errors and exact shares, attention masses per layer, answers by kind per variant, and
    (where the results have them) errors by tenth of the prompt and answers by the asked needle's depth."""
    mean = lambda key: sum(r[key] for r in results) / len(results)  # noqa: E731

    def rank(group: str) -> str:  # over the examples whose layers coded some of the group's tokens
        ranks = [r[f"mean rank: {group}"] for r in results if r.get(f"mean rank: {group}") is not None]
        return f" {sum(ranks) / len(ranks):.1f} |" if ranks else " n/a |"

    groups = [g for g in GROUPS if any(r.get(f"tokens: {g}", 1) for r in results)]
    needles = [n for n in NEEDLES if all(f"attention full L{layers[0]}: {n}" in r for r in results)]
    def later(key: str, form: str) -> str:  # a column added after some results were saved: over those that have it
        found = [r[key] for r in results if r.get(key) is not None]
        return f" {sum(found) / len(found):{form}} |" if found else " n/a |"

    worst, read = f"in worst {min(WORST.values()):.0%}", f"most read {max(ATTENDED.values()):.0%}"
    novel = f"most novel {max(NOVEL.values()):.0%}"
    lines = ["| group | key rel. error | value rel. error | stored exactly | mean rank of its coded tokens "
             f"| coded keys' norm / exact | {worst} of keys | in the {read} | in the {novel} |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {g} | {mean(f'key error: {g}'):.3f} | {mean(f'value error: {g}'):.3f} | "
              f"{mean(f'exact share: {g}'):.1%} |" + rank(g) + later(f"key norm ratio: {g}", ".3f")
              + later(f"{worst}: {g}", ".1%") + later(f"most read: {g}", ".1%") + later(f"most novel: {g}", ".1%")
              for g in groups]
    heads = [f"{name}: {needle}" + (" (3)" if needle == "other needles" else "") for name in ("full", "codes")
             for needle in needles]
    lines += ["", "| layer | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    lines += [f"| {i} | " + " | ".join(f"{mean(f'attention {name} L{i}: {needle}'):.4f}" for name in ("full", "codes")
                                      for needle in needles) + " |" for i in layers]
    graded = all("answer nll" in r for r in results)
    lines += ["", "| variant | " + " | ".join(KINDS) + " | vs codes: +right / -right | vs full: +right / -right |"
              + (" answer NLL vs full (nats; +: surer) |" if graded else ""),
              "|---|" + "---|" * (len(KINDS) + 2 + graded)]
    answers = [r["answers"] for r in results]
    for variant in answers[0]:
        count = collections.Counter(a[variant] for a in answers)
        lines.append(f"| {variant} | " + " | ".join(str(count[k]) for k in KINDS) + " | "
                     + " | ".join("+{} / -{}".format(*flips(answers, variant, other)) for other in ("codes", "full"))
                     + " |" + (f" {nll_gap(results, variant)} |" if graded else ""))
    if all("key error: tenth 0" in r for r in results):
        lines += ["", "| tenth of the prompt | key rel. error | value rel. error | keys stored exactly |",
                  "|---|---|---|---|"]
        lines += [f"| {t} | {mean(f'key error: tenth {t}'):.3f} | {mean(f'value error: tenth {t}'):.3f} | "
                  f"{mean(f'exact share: tenth {t}'):.1%} |" for t in range(TENTHS)]
    if all("depth" in r for r in results):
        lines += ["", depth_table(results, layers, list(answers[0]))]
    return "\n".join(lines)


def depth_table(results: list[dict], layers: list[int], variants: list[str]) -> str:
    """Markdown: per fifth of the document the asked needle sits in, the examples each variant answers right (and
    their answer NLL against the full cache's, where the results have it), the key error of the asked needle's
    other words ("asked rest"), and the asked needle's attention mass, mean over `layers`, over the full and the
    coded keys."""
    graded = [v for v in variants if v != "full" and all("answer nll" in r for r in results)]
    lines = ["| asked needle's depth | n | " + " | ".join(f"right: {v}" for v in variants)
             + "".join(f" | NLL vs full: {v}" for v in graded)
             + " | key error: asked rest | attention full | attention codes |",
             "|---|---|" + "---|" * (len(variants) + len(graded) + 3)]
    for fifth, rows in by_fifth(results, lambda r: r["depth"]):
        right = [sum(r["answers"][v] == "right" for r in rows) for v in variants] + [nll_gap(rows, v) for v in graded]
        error = sum(r["key error: asked rest"] for r in rows) / len(rows)
        mass = {name: sum(r[f"attention {name} L{i}: asked needle"] for r in rows for i in layers)
                / (len(rows) * len(layers)) for name in ("full", "codes")}
        lines.append(f"| {fifth} | {len(rows)} | " + " | ".join(map(str, right))
                     + f" | {error:.3f} | {mass['full']:.4f} | {mass['codes']:.4f} |")
    return "\n".join(lines)


def nll_gap(results: list[dict], variant: str) -> str:
    """The full cache's mean answer NLL minus `variant`'s over `results`, with its bootstrap 95% CI, signed as the
    evaluation report signs it (positive: `variant` is surer of the right answer than the full cache)."""
    return interval([r["answer nll"]["full"] - r["answer nll"][variant] for r in results], ".3f")


def flips(answers: list[dict], variant: str, other: str) -> tuple[int, int]:
    """(examples `variant` answers right and `other` does not, the reverse): the paired discordant counts."""
    right = [(a[variant] == "right", a[other] == "right") for a in answers]
    return sum(v and not o for v, o in right), sum(o and not v for v, o in right)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--task", default="niah_multikey", choices=TASKS)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--n", type=int, default=40, help="examples first .. first + n - 1")
    parser.add_argument("--first", type=int, default=100, help="the first example (default: the development split)")
    parser.add_argument("--method", default="recommended@0.2", help="a varrate method of evaluation/configs/full.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the method's spec (a VarRateConfig field, YAML value), e.g. "
                        "--set signal=residual; repeatable")
    parser.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="a directory for examples.jsonl (per example) and summary.md (the tables)")
    args = parser.parse_args(argv)
    if args.n < 1:
        raise SystemExit(f"--n must be at least 1, got {args.n}")
    return args


def chosen_method(args) -> tuple:
    """(the method full.yaml's `--method` names with `--set` on top, its display name, the variants to run);
    every argument is checked here, before a model loads."""
    spec = load_config(REPO / "evaluation/configs/full.yaml").methods.get(args.method)
    if spec is None or spec["kind"] != "varrate":
        raise SystemExit(f"--method {args.method!r} is not a varrate method of evaluation/configs/full.yaml")
    overrides = {}
    for item in args.set:
        field, equals, value = item.partition("=")
        if not equals or not field:
            raise SystemExit(f"--set {item!r}: write FIELD=VALUE, e.g. --set signal=residual")
        overrides[field] = yaml.safe_load(value)
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants {unknown} unknown; choose among {list(VARIANTS)}")
    variants = ["codes", *(v for v in variants if v != "codes")]
    name = args.method + (" with " + ", ".join(f"{k}={v}" for k, v in overrides.items()) if overrides else "")
    method = make_method(name, {**spec, **overrides, "storage": "materialized"})  # patches write into the K/V
    return method, name, variants


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    method, name, variants = chosen_method(args)
    model, tokenizer = load_default_model(args.model)
    chat = DEFAULT_MODELS[args.model].chat_template
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "examples.jsonl").write_text("")
    results = []
    torch.set_grad_enabled(False)
    for example in build_examples(args.task, tokenizer, chat, args.length, args.n, first=args.first):
        results.append(diagnose(model, tokenizer, args.model, example, method, variants))
        print(example.example_id, results[-1]["answers"], flush=True)
        if out:
            with (out / "examples.jsonl").open("a") as f:
                f.write(json.dumps({"example_id": example.example_id, **results[-1]}, sort_keys=True) + "\n")
    command = "python -m studies.needle_attention " + shlex.join(argv if argv is not None else sys.argv[1:])
    summary = (f"# {args.model}, {args.task} at {args.length}, examples {args.first}-{args.first + args.n - 1}, "
               f"query-agnostic, {name}\n\n`{command}`; full-attention layers {full_attention_layers(model)}; "
               f"attention: at the token that predicts the answer, mean over query heads\n\n"
               + summarize(results, full_attention_layers(model)) + "\n")
    print("\n" + summary)
    if out:
        (out / "summary.md").write_text(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
