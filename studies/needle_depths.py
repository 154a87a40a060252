"""Where along the document one method loses to another: `python -m studies.needle_depths`.

The report's depth table gives each method's score per depth of the asked needle; this pairs two methods
example by example and asks where the difference sits. It reads a run's examples.jsonl and prints, per
(model, length, regime), tasks pooled and each task, for each fifth of the document the asked needle sits in:
the answers' paired difference (A - B, points) and the answer NLL's (B - A in nats an answer token, as the
report signs it: positive, A is surer of the right answer; needs a run with `answer_nll: true`), each with its
bootstrap CI; then the contrast early - late (the mean difference for needles at depths below `--early` minus
that at `--late` and above, resampling each side apart): a CI that excludes 0 says A's loss depends on where
the needle is.

    python -m studies.needle_depths --results evaluation/runs/depth_dev

A reading of rows already run: no model loads, nothing is chosen on it.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

from evaluation.stats import BOOTSTRAP_SAMPLES, bootstrap_mean_ci
from evaluation.tasks.needle import depth_bin

FIFTHS = 5


def paired_rows(rows: list[dict], a: str, b: str) -> dict[tuple, list[tuple[float, float, float | None]]]:
    """{(model, length, regime, task): [(depth, A - B score in points, B - A answer NLL or None)]} over the
    examples both methods ran."""
    by = collections.defaultdict(dict)
    for row in rows:
        if row["method"] in (a, b) and "depth" in row:
            by[(row["model"], row["length"], row["regime"], row["task"], row["example_id"])][row["method"]] = row
    pairs = collections.defaultdict(list)
    for key, methods in sorted(by.items()):
        if len(methods) < 2:
            continue
        ra, rb = methods[a], methods[b]
        graded = ra.get("answer_nll") is not None and rb.get("answer_nll") is not None
        nll = rb["answer_nll"] - ra["answer_nll"] if graded else None
        pairs[key[:4]].append((ra["depth"], 100 * (ra["score"] - rb["score"]), nll))
    return pairs


def contrast(early, late, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean(early) - mean(late), its percentile bootstrap 95% CI), each side resampled with replacement apart."""
    early, late = np.asarray(early, dtype=np.float64), np.asarray(late, dtype=np.float64)
    if early.size < 2 or late.size < 2:
        return float(early.mean() - late.mean()) if early.size and late.size else np.nan, np.nan, np.nan
    rng = np.random.default_rng(seed)
    draws = rng.choice(early, (samples, early.size)).mean(axis=1) - rng.choice(late, (samples, late.size)).mean(axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(early.mean() - late.mean()), float(low), float(high)


def by_fifth(items, depth) -> list[tuple[str, list]]:
    """[(a fifth of the document as "0.2-0.4", the items whose `depth(item)` falls in it)], in depth order; depth 1
    falls in the last fifth."""
    fifths = collections.defaultdict(list)
    for item in items:
        fifths[depth_bin(depth(item), FIFTHS)].append(item)
    return [(f"{k / FIFTHS:.1f}-{(k + 1) / FIFTHS:.1f}", rows) for k, rows in sorted(fifths.items())]


def interval(values, scale: str, samples: int = BOOTSTRAP_SAMPLES) -> str:
    """"mean [low, high]" of `values` (None dropped) with its bootstrap 95% CI, signed, in format `scale`."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    low, high = bootstrap_mean_ci(values, samples=samples)
    return f"{np.mean(values):+{scale}} [{low:+{scale}}, {high:+{scale}}]"


def table(cell: str, pairs: list[tuple], early: float, late: float, samples: int) -> str:
    """Markdown: one cell's rows per fifth of depth, then the early - late contrast of both differences."""
    lines = [f"### {cell}", "", "| asked needle's depth | n | answers, A - B (points) | answer NLL, A surer (nats) |",
             "|---|---|---|---|"]
    for fifth, rows in by_fifth(pairs, lambda pair: pair[0]):
        answers, nll = interval([r[1] for r in rows], ".1f", samples), interval([r[2] for r in rows], ".3f", samples)
        lines.append(f"| {fifth} | {len(rows)} | {answers} | {nll} |")
    parts = []
    for name, column, scale in (("answers", 1, ".1f"), ("answer NLL", 2, ".3f")):
        sides = [[p[column] for p in pairs if keep(p[0]) and p[column] is not None]
                 for keep in (lambda d: d < early, lambda d: d >= late)]
        if all(len(side) for side in sides):
            mean, low, high = contrast(*sides, samples=samples)
            parts.append(f"{name} {mean:+{scale}} [{low:+{scale}}, {high:+{scale}}]")
    counts = (sum(p[0] < early for p in pairs), sum(p[0] >= late for p in pairs))
    lines += ["", f"Early - late (depth < {early} against >= {late}; n = {counts[0]} / {counts[1]}): "
              + ("; ".join(parts) or "n/a") + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="evaluation/runs/depth_dev", help="a run's output directory")
    parser.add_argument("--a", default="recommended@0.2", help="method A (default: recommended@0.2)")
    parser.add_argument("--b", default="full", help="method B, the reference (default: full)")
    parser.add_argument("--early", type=float, default=0.4, help="needles at depths below this are early")
    parser.add_argument("--late", type=float, default=0.6, help="needles at depths from this on are late")
    parser.add_argument("--samples", type=int, default=BOOTSTRAP_SAMPLES, help="bootstrap resamples")
    args = parser.parse_args(argv)
    if not 0 < args.early <= args.late < 1:
        raise SystemExit(f"--early {args.early} and --late {args.late}: need 0 < early <= late < 1, e.g. 0.4 and 0.6")
    path = Path(args.results) / "examples.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: --results names a run's output directory, e.g. "
                         f"evaluation/runs/depth_dev")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = paired_rows(rows, args.a, args.b)
    if not pairs:
        raise SystemExit(f"{path} has no needle example that both --a {args.a!r} and --b {args.b!r} ran")
    print(f"# {args.a} (A) against {args.b} (B), by the asked needle's depth: {path}\n")
    pooled = collections.defaultdict(list)
    for (model, length, regime, task), cell in pairs.items():
        pooled[(model, length, regime)] += cell
    for (model, length, regime), cell in pooled.items():
        tasks = sorted(k[3] for k in pairs if k[:3] == (model, length, regime))
        print(table(f"{model}, {length}, {regime}: {' + '.join(tasks)}", cell, args.early, args.late, args.samples))
        print()
        if len(tasks) > 1:
            for task in tasks:
                print(table(f"{model}, {length}, {regime}: {task}", pairs[(model, length, regime, task)], args.early,
                            args.late, args.samples))
                print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
