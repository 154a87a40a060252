"""Multi-key needles: is a wrong answer another needle's value? `python -m studies.needle_confusions`.

RULER's multi-key task plants four needles "One of the special magic numbers for {key} is: {value}."
and asks for one key. A wrong answer is either another planted needle's value (the model found the
needles but bound the asked key to the wrong one: a confusion) or a number that was never planted
(the value itself was lost). This reads a run's examples.jsonl, rebuilds each example's prompt as
the runner does (tokenizer only, no forward pass), and counts the kinds per method, length and regime.

    python -m studies.needle_confusions --model gemma-3-270m

It reads the rows of `python -m evaluation.run --config evaluation/configs/full.yaml` (evaluation/runs/full/);
the rows docs/evaluation.md cites are in git history: `git show 81a3a85:evaluation/results/full/examples.jsonl`.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from hf_varrate.models import DEFAULT_MODELS, load_default_model

from evaluation.tasks import build_examples
from evaluation.tasks.needle import NEEDLE

KINDS = ("right", "another needle", "not planted", "no number")


def template_pattern(template: str, **groups: str) -> re.Pattern:
    """A task template ("... {key} ...") as a regex: its text literal, each {field} replaced by its group."""
    pattern = re.escape(template)
    for field, group in groups.items():
        pattern = pattern.replace(re.escape("{" + field + "}"), group)
    return re.compile(pattern)


NEEDLE_PATTERN = template_pattern(NEEDLE, key=r"(\S+)", value=r"(\d+)")


def planted(text: str) -> dict[str, str]:
    """{key: value} of the needles in a prompt's text."""
    return dict(NEEDLE_PATTERN.findall(text))


def classify(prediction: str, answer: str, values: dict[str, str]) -> str:
    """One of KINDS: the answer appears (as the task scores it), else what the first number in the prediction is."""
    if answer in prediction:
        return "right"
    number = re.search(r"\d+", prediction)
    if number is None:
        return "no number"
    return "another needle" if number.group(0) in set(values.values()) - {answer} else "not planted"


def confusions(rows: list[dict], texts: dict[tuple[int, str], str]) -> dict[tuple, collections.Counter]:
    """Counts of KINDS per (length, regime, method); texts[(length, example_id)] is the prompt's text."""
    counts = collections.defaultdict(collections.Counter)
    for row in rows:
        values = planted(texts[(row["length"], row["example_id"])])
        counts[(row["length"], row["regime"], row["method"])][
            classify(row["prediction"], row["answers"][0], values)] += 1
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="evaluation/runs/full", help="a run's output directory")
    parser.add_argument("--model", default="gemma-3-270m", choices=sorted(DEFAULT_MODELS))
    args = parser.parse_args(argv)
    path = Path(args.results) / "examples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["model"] == args.model and r["task"] == "niah_multikey"]
    if not rows:
        raise SystemExit(f"{path} has no niah_multikey rows for {args.model}")
    _, tokenizer = load_default_model(args.model)
    chat = DEFAULT_MODELS[args.model].chat_template
    texts = {}
    for length in sorted({r["length"] for r in rows}):
        n = 1 + max(int(r["example_id"].rsplit("-", 1)[1]) for r in rows if r["length"] == length)
        for example in build_examples("niah_multikey", tokenizer, chat, length, n):
            texts[(length, example.example_id)] = tokenizer.decode(example.segments.context)
    counts = confusions(rows, texts)
    print(f"{args.model}, niah_multikey: answers by kind (another needle: the value of a planted key that was "
          f"not asked)\n")
    print("| length | regime | method | n | " + " | ".join(KINDS) + " |")
    print("|---|---|---|---|" + "---|" * len(KINDS))
    for (length, regime, method), count in sorted(counts.items()):
        print(f"| {length} | {regime} | {method} | {sum(count.values())} | "
              + " | ".join(str(count[kind]) for kind in KINDS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
