"""Tables from examples.jsonl: per-cell scores with CIs, footprints, costs, and paired comparisons.

A cell is (model, task, length, regime); scores are RULER's per-example match in percent, or for
perplexity tasks the per-example mean NLL (reported as PPL = exp(mean NLL)). Comparisons pair two
methods on the examples both completed; for NLL, a positive difference means the first is better.
"""

from __future__ import annotations

import csv
import math
import re
from collections import defaultdict
from statistics import median

import numpy as np

from .stats import bootstrap_mean_ci, paired_comparison
from .tasks.needle import depth_bin

CELL = ("model", "task", "length", "regime")


def cells(rows: list[dict]) -> dict[tuple, dict[str, dict[str, dict]]]:
    """cell -> method -> example_id -> row."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        out[tuple(row[k] for k in CELL)][row["method"]][row["example_id"]] = row
    return out


def summarize(rows: list[dict], samples: int = 20_000) -> list[dict]:
    table = []
    for cell, methods in sorted(cells(rows).items(), key=lambda kv: tuple(map(str, kv[0]))):
        for method, by_id in methods.items():
            rs = list(by_id.values())
            scores = np.array([r["score"] for r in rs], dtype=float)
            nll = rs[0]["metric"] == "nll"
            low, high = bootstrap_mean_ci(scores, samples=samples)
            scale = (lambda x: math.exp(x)) if nll else (lambda x: 100 * x)  # noqa: E731
            table.append({
                **dict(zip(CELL, cell)), "method": method, "kind": rs[0]["kind"], "budget": rs[0].get("budget"),
                "n": len(rs), "metric": "ppl" if nll else "score",
                "value": scale(float(scores.mean())), "ci_low": scale(low), "ci_high": scale(high),
                "fraction": float(np.mean([r["fraction"] for r in rs])),
                "fraction_full_attention": float(np.mean([r["fraction_full_attention"] for r in rs])),
                "bytes": float(np.mean([r["bytes"] for r in rs])),
                "fraction_fp16": _mean_or_none([r.get("fraction_fp16") for r in rs]),
                "cost": median(r["cost"] for r in rs),
                "prompt_tokens": float(np.mean([r["prompt_tokens"] for r in rs])),
            })
    return table


def pooled(rows: list[dict]) -> list[dict]:
    """The needle tasks pooled per example (the paper's Appendix A.16: more pairs, same question)."""
    return [{**row, "task": "niah (pooled)"} for row in rows if row["task"].startswith("niah")]


def compare(rows: list[dict], pairs: list[list[str]], samples: int = 20_000, value: str = "score") -> list[dict]:
    """Paired comparisons per cell, plus per (model, length, regime) over the needle tasks pooled.

    `value` "answer_nll" compares the gold answer's NLL instead of the score (rows that have one; positive: A
    is surer of the right answer), in nats per answer token."""
    if value == "answer_nll":
        rows = [row for row in rows if row.get("answer_nll") is not None]
    out = []
    for cell, methods in sorted(cells(rows + pooled(rows)).items(), key=lambda kv: tuple(map(str, kv[0]))):
        for a, b in pairs:
            if a not in methods or b not in methods:
                continue
            ids = sorted(set(methods[a]) & set(methods[b]))
            if not ids:
                continue
            nll = value == "answer_nll" or methods[a][ids[0]]["metric"] == "nll"
            sa = [methods[a][i][value] for i in ids]
            sb = [methods[b][i][value] for i in ids]
            result = paired_comparison(sb, sa, samples=samples) if nll else paired_comparison(
                [100 * x for x in sa], [100 * x for x in sb], samples=samples)
            unit = "nats / answer token" if value == "answer_nll" else "nll" if nll else "points"
            out.append({**dict(zip(CELL, cell)), "a": a, "b": b, "unit": unit,
                        **result.to_dict(), "fraction_a": _mean_fraction(methods[a], ids),
                        "fraction_b": _mean_fraction(methods[b], ids)})
    return out


def needle_ranks(rows: list[dict], bins: int = 5) -> list[dict]:
    """Needle score by the (asked) needle's depth, beside the mean rank the codec gave the tenth of the
    prompt at that depth (`rank_by_decile`; depths are fractions of the document, which is all of the
    prompt but a few dozen template tokens): where the needle sits against where the rank went. One row
    per (cell, method with a rank profile, depth bin); depth bin k covers [k / bins, (k + 1) / bins).
    `coded` counts the rows whose prompt was coded (the rank averages over those; None if none was)."""
    groups: dict = defaultdict(list)
    for row in rows:
        if row["task"].startswith("niah") and row.get("rank_by_decile") and row.get("depth") is not None:
            k = depth_bin(row["depth"], bins)
            groups[(*(row[c] for c in CELL), row["method"], k)].append(row)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        ranks = [r["rank_by_decile"][depth_bin(r["depth"], 10)] for r in rs]
        ranks = [rank for rank in ranks if rank is not None]  # None: that prompt was stored exactly
        out.append({**dict(zip((*CELL, "method"), key[:-1])), "depth_low": key[-1] / bins,
                    "depth_high": (key[-1] + 1) / bins, "n": len(rs),
                    "score": 100 * float(np.mean([r["score"] for r in rs])),
                    "rank_at_needle": float(np.mean(ranks)) if ranks else None, "coded": len(ranks)})
    return out


def needle_digits(rows: list[dict]) -> list[dict]:
    """How much of each needle's number the answer reproduces, per (cell, method): RULER's exact score
    beside the mean share of the number's digits the answer's first run of digits gets right from the
    start ("2048." for 2049948: 3 of 7), and the share of answers whose first digit is right. A method
    that finds the needle but cannot copy it shows a high first-digit share and a low exact score."""
    groups: dict = defaultdict(list)
    for row in rows:
        if row["task"].startswith("niah") and row.get("prediction") is not None and row.get("answers"):
            groups[(*(row[c] for c in CELL), row["method"])].append(row)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        leading = [max(_leading_digits(r["prediction"], answer) / len(answer) for answer in r["answers"]) for r in rs]
        first = [any(_leading_digits(r["prediction"], answer) > 0 for answer in r["answers"]) for r in rs]
        out.append({**dict(zip((*CELL, "method"), key)), "n": len(rs),
                    "score": 100 * float(np.mean([r["score"] for r in rs])),
                    "leading_digits": 100 * float(np.mean(leading)), "first_digit": 100 * float(np.mean(first))})
    return out


def _leading_digits(prediction: str, answer: str) -> int:
    """Digits of `answer` that the first run of digits in `prediction` matches from the start."""
    match = re.search(r"\d+", prediction)
    got = match.group() if match else ""
    return next((i for i, (a, b) in enumerate(zip(got, answer)) if a != b), min(len(got), len(answer)))


def progress(rows: list[dict], config) -> list[dict]:
    """Planned vs completed examples per (stage cell, method): what is not yet run."""
    done: dict = defaultdict(set)
    for row in rows:
        done[(row["model"], row["task"], row["length"], row["regime"], row["method"])].add(row["example_id"])
    out = []
    for stage in config.stages:
        for task in stage.tasks:
            regimes = ["query_agnostic"] if task.startswith("ppl") else stage.regimes
            for length in stage.lengths:
                for regime in regimes:
                    for method in stage.methods:
                        n = len(done[(stage.model, task, length, regime, method)])
                        out.append({"model": stage.model, "task": task, "length": length, "regime": regime,
                                    "method": method, "planned": stage.n, "done": n})
    return out


def write_csv(path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def markdown_summary(table: list[dict]) -> str:
    lines = ["| model | task | length | regime | method | n | score / PPL [95% CI] | footprint | cost vs prefill |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['task']} | {r['length']} | {r['regime']} | {r['method']} | {r['n']} | "
                     f"{r['value']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] | {_fraction(r)} | {r['cost']:.2f}x |")
    return "\n".join(lines)


def markdown_comparisons(comparisons: list[dict]) -> str:
    lines = ["| model | task | length | regime | A vs B | footprint A / B | n | mean diff [95% CI] | W/L/T | sign p | "
             "verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c['model']} | {c['task']} | {c['length']} | {c['regime']} | {c['a']} vs {c['b']} | "
                     f"{100 * c['fraction_a']:.1f}% / {100 * c['fraction_b']:.1f}% | {c['n']} | "
                     f"{c['mean_diff']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] {c['unit']} | "
                     f"{c['wins']}/{c['losses']}/{c['ties']} | {c['sign_p']:.3g} | {c['verdict']} |")
    return "\n".join(lines)


def markdown_needle_ranks(needle_rows: list[dict]) -> str:
    """One line per (cell, method): score % (mean rank at the needle's decile) per depth bin."""
    if not needle_rows:
        return "No needle rows with a rank profile yet."
    lines: dict = {}
    edges: set = set()
    for r in needle_rows:
        edge = (r["depth_low"], r["depth_high"])
        edges.add(edge)
        lines.setdefault(tuple(r[k] for k in (*CELL, "method")), {})[edge] = r
    edges = sorted(edges)
    out = ["| model | task | length | regime | method | "
           + " | ".join(f"depth {low:.1f}-{high:.1f}" for low, high in edges) + " |",
           "|---|---|---|---|---|" + "---|" * len(edges)]
    for key, by_edge in lines.items():
        cells_ = [_needle_cell(by_edge[e]) if e in by_edge else "" for e in edges]
        out.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells_) + " |")
    return "\n".join(out)


def markdown_needle_digits(digit_rows: list[dict]) -> str:
    if not digit_rows:
        return "No needle rows yet."
    lines = ["| model | task | length | regime | method | n | exact | digits from the start | first digit right |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['task']} | {r['length']} | {r['regime']} | {r['method']} | {r['n']} | "
              f"{r['score']:.0f}% | {r['leading_digits']:.0f}% | {r['first_digit']:.0f}% |" for r in digit_rows]
    return "\n".join(lines)


def markdown_progress(progress_rows: list[dict]) -> str:
    missing = [p for p in progress_rows if p["done"] < p["planned"]]
    if not missing:
        return "Every planned cell is complete."
    lines = ["| model | task | length | regime | method | done / planned |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['model']} | {p['task']} | {p['length']} | {p['regime']} | {p['method']} | "
              f"{p['done']} / {p['planned']} |" for p in missing]
    return "\n".join(lines)


def _fraction(r: dict) -> str:
    fp16 = f" ({100 * r['fraction_fp16']:.2f}% in fp16)" if r.get("fraction_fp16") is not None else ""
    if abs(r["fraction"] - r["fraction_full_attention"]) < 1e-6:
        return f"{100 * r['fraction']:.2f}%{fp16}"
    return f"{100 * r['fraction']:.2f}% ({100 * r['fraction_full_attention']:.2f}% of global layers){fp16}"


def _needle_cell(r: dict) -> str:
    if r["rank_at_needle"] is None:
        rank = "stored exactly"
    else:
        rank = f"{r['rank_at_needle']:.0f}" + (f", {r['coded']} coded" if r["coded"] < r["n"] else "")
    return f"{r['score']:.0f}% ({rank}; n = {r['n']})"


def _mean_fraction(by_id: dict, ids: list) -> float:
    """The mean measured footprint of a method's rows for these examples."""
    return float(np.mean([by_id[i]["fraction"] for i in ids]))


def _mean_or_none(values: list) -> float | None:
    """The mean of the values, or None when any row lacks one (rows from before the field existed)."""
    return None if any(v is None for v in values) else float(np.mean(values))
