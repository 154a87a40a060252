"""Figures from the summary table and the per-example rows (matplotlib, Agg backend).

- accuracy_vs_budget_<model>_<task>.png: score vs measured footprint, one line per method family
  (the part of the method name before '@'), full cache dashed; one panel per regime.
- accuracy_vs_cost_<model>.png: query-agnostic score vs compression cost relative to a plain prefill
  (log x), the paper's Figure 4, one panel per task.
- rank_by_position_<model>.png: VarRate's mean allocated rank of coded tokens by position decile
  (the paper's Figure 7), per method and regime, with the r_min floor.
- needle_heatmap_<model>_<task>.png: accuracy by needle depth x context length, per method and regime.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def family(method: str) -> str:
    return method.split("@")[0]


def accuracy_vs_budget(table: list[dict], out: Path) -> list[Path]:
    plt, paths = _plt(), []
    groups = defaultdict(list)
    for r in table:
        groups[(r["model"], r["task"], r["length"])].append(r)
    for (model, task, length), rs in groups.items():
        regimes = sorted({r["regime"] for r in rs})
        fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4.2), squeeze=False)
        for ax, regime in zip(axes[0], regimes):
            lines = defaultdict(list)
            for r in rs:
                if r["regime"] == regime:
                    lines[family(r["method"])].append(r)
            for fam, pts in sorted(lines.items()):
                if fam == "full":
                    ax.axhline(pts[0]["value"], color="k", ls="--", label="full")
                    continue
                pts.sort(key=lambda r: r["fraction_full_attention"])
                x = [100 * r["fraction_full_attention"] for r in pts]
                y = [r["value"] for r in pts]
                err = [[r["value"] - r["ci_low"] for r in pts], [r["ci_high"] - r["value"] for r in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=fam)
            ax.set(title=f"{regime}", xlabel="measured footprint (% of full K/V, compressed layers)",
                   ylabel="PPL" if rs[0]["metric"] == "ppl" else "score (%)")
            ax.legend(fontsize=7)
        fig.suptitle(f"{model} · {task} · {length} tokens")
        fig.tight_layout()
        paths.append(out / f"accuracy_vs_budget_{model}_{task}_L{length}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def colors(names) -> dict:
    """One fixed colour per method name, the same in every panel."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {name: cmap(i % 20) for i, name in enumerate(sorted(set(names)))}


def accuracy_vs_cost(table: list[dict], out: Path) -> list[Path]:
    plt, paths = _plt(), []
    color = colors(r["method"] for r in table)
    by_model = defaultdict(list)
    for r in table:
        if r["regime"] == "query_agnostic" and r["metric"] == "score":
            by_model[r["model"]].append(r)
    for model, rs in by_model.items():
        keys = sorted({(r["task"], r["length"]) for r in rs})
        fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False)
        for ax, (task, length) in zip(axes[0], keys):
            for r in sorted(rs, key=lambda r: r["method"]):
                if (r["task"], r["length"]) == (task, length):
                    ax.errorbar(r["cost"], r["value"], yerr=[[r["value"] - r["ci_low"]], [r["ci_high"] - r["value"]]],
                                marker="o", capsize=3, ls="none", label=r["method"], color=color[r["method"]])
            ax.set_xscale("log")
            ax.set(title=f"{task} · {length}", xlabel="compression cost (x plain prefill, median)", ylabel="score (%)")
            ax.legend(fontsize=6)
        fig.suptitle(f"{model} · query-agnostic reuse: accuracy vs cost")
        fig.tight_layout()
        paths.append(out / f"accuracy_vs_cost_{model}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def rank_by_position(rows: list[dict], out: Path, r_min: int = 16) -> list[Path]:
    """The paper's Figure 7: mean allocated rank by position decile, one panel per regime, one curve per
    method (over every task's rows, needles and perplexity; prompts stored exactly have no ranks and are
    left out)."""
    plt, paths = _plt(), []
    curves = defaultdict(list)
    for row in rows:
        if row.get("rank_by_decile") and any(r is not None for r in row["rank_by_decile"]):
            curves[(row["model"], row["regime"], row["method"])].append(row["rank_by_decile"])
    for model in sorted({k[0] for k in curves}):
        regimes = sorted({k[1] for k in curves if k[0] == model})
        fig, axes = plt.subplots(1, len(regimes), figsize=(5.2 * len(regimes) + 2.4, 4.2), sharey=True, squeeze=False)
        methods = sorted({k[2] for k in curves if k[0] == model})
        palette = plt.get_cmap("tab20").colors
        colors = {m: palette[i % len(palette)] for i, m in enumerate(methods)}  # the same colour in both panels
        for ax, regime in zip(axes[0], regimes):
            for method in methods:
                vals = curves.get((model, regime, method))
                if not vals:
                    continue
                with warnings.catch_warnings():  # a decile with no coded token (the exact window) is NaN
                    warnings.simplefilter("ignore", RuntimeWarning)
                    curve = np.nanmean(np.array(vals, dtype=float), axis=0)
                ax.plot(range(10), curve, marker="o", ms=3, color=colors[method], label=method)
            ax.axhline(r_min, color="gray", ls=":", label=f"r_min = {r_min}")
            ax.set(xlabel="position decile of the compressed prompt (0 = start)", title=regime.replace("_", "-"))
        axes[0][0].set_ylabel("mean allocated rank")
        handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=7)
        fig.suptitle(f"{model}: where the rank budget goes")
        fig.tight_layout(rect=(0, 0, 1 - 2.4 / (5.2 * len(regimes) + 2.4), 1))
        paths.append(out / f"rank_by_position_{model}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def needle_heatmap(rows: list[dict], out: Path) -> list[Path]:
    plt, paths = _plt(), []
    acc = defaultdict(list)
    for row in rows:
        if row["task"].startswith("niah") and row.get("depth") is not None:
            depth = min(int(row["depth"] * 5), 4) / 5  # quintile bins
            acc[(row["model"], row["task"], row["method"], row["regime"], row["length"], depth)].append(row["score"])
    for model, task in sorted({(k[0], k[1]) for k in acc}):
        panels = sorted({(k[2], k[3]) for k in acc if k[:2] == (model, task)})
        lengths = sorted({k[4] for k in acc if k[:2] == (model, task)})
        depths = [i / 5 for i in range(5)]
        cols = 4
        rows_n = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.6 * rows_n), squeeze=False)
        for ax, (method, regime) in zip(axes.flat, panels):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for a, d in enumerate(depths):
                for b, length in enumerate(lengths):
                    vals = acc.get((model, task, method, regime, length, d))
                    if vals:
                        grid[a, b] = 100 * np.mean(vals)
            ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=6)
            ax.set_yticks(range(len(depths)), [f"{d:.1f}-{d + 0.2:.1f}" for d in depths], fontsize=6)
            ax.set_title(f"{method}\n{regime}", fontsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(f"{model} · {task}: accuracy by needle depth (rows) x length (cols)")
        fig.tight_layout()
        paths.append(out / f"needle_heatmap_{model}_{task}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
