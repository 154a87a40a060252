"""Shared pieces of the benchmarks: models, prompts, timing, output; capture and replay come from evaluation/.

Every benchmark measures its comparisons side by side in one process (or one script run), repeats
them, and reports medians and the spread; results go to benchmarks/runs/<name>.json and .md (not
tracked; the numbers the README cites are copied to docs/results/benchmarks/).
"""

from __future__ import annotations

import ast
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "runs"
if str(REPO) not in sys.path:  # the scripts run as files; evaluation/ (the capture toolkit) sits beside them
    sys.path.append(str(REPO))  # appended: an earlier hf_varrate on PYTHONPATH (bench_versions.py) still wins

from evaluation.capture import Captured, capture, replay  # noqa: E402
from hf_varrate.binding import cache_kwarg  # noqa: E402


# environment ---------------------------------------------------------------------------------------------
DEVICE = torch.device("cpu")  # where the models run (`use_device`, from each script's --device)


def set_threads(threads: int) -> None:
    """`threads` intra-op threads; 0 keeps torch's default (what a user gets)."""
    if threads:
        torch.set_num_threads(threads)


def use_device(name: str) -> torch.device:
    """Run the benchmark's models on `name` ('cpu', 'cuda', 'cuda:1'); exits with the reason where torch
    cannot reach that device."""
    global DEVICE
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch {torch.__version__} sees no CUDA device (built with CUDA "
                         f"{torch.version.cuda or 'none: a CPU-only build'}); run on a machine with an NVIDIA GPU "
                         f"and a CUDA build of torch, or pass --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda[:index], got {name!r}")
    DEVICE = device
    return device


def clock() -> float:
    """Wall seconds, once the device has finished what was queued (CUDA runs asynchronously: without the
    synchronization a timing would measure the kernel launches only)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


def environment() -> dict:
    """What the numbers were measured on (the load average says how shared the machine was)."""
    import transformers

    from hf_varrate.codec import native

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(DEVICE), "cuda": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else None,
            "native_loops": native.available(), "load_average": os.getloadavg(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


# models and prompts ------------------------------------------------------------------------------------------
def load(name: str, dtype: str = "float32"):
    from hf_varrate.models import load_default_model

    model, tokenizer = load_default_model(name, dtype=getattr(torch, dtype))
    return model.to(DEVICE).eval(), tokenizer


def bases_for(name: str, model):
    """The shipped calibrated bases for `name` if the package has them, else the identity basis
    (the codec's cost depends only on the rank R, which is D either way for these models)."""
    from hf_varrate import Bases
    from hf_varrate.shipped import shipped_path

    folder = shipped_path(name)
    if folder is not None and (folder / "bases.safetensors").is_file():
        return Bases.from_pretrained(name), name
    return Bases.identity(model.config), "identity"


def field_overrides(items: list[str]) -> dict:
    """`--set FIELD=VALUE` arguments as VarRateConfig overrides: VALUE read as a Python literal (4, 0.5, None)
    or else kept as a string (coef_scales=token); fields and values are checked where the config is built."""
    overrides = {}
    for item in items:
        field, equals, value = item.partition("=")
        if not equals or not field:
            raise SystemExit(f"--set {item!r}: write FIELD=VALUE, e.g. --set coef_scales=token")
        try:
            overrides[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[field] = value
    return overrides


def document_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """[1, length] token ids of real text (the RULER haystack essays) if installed, else random ids."""
    try:
        from hf_varrate.demo import essay_text

        ids = tokenizer(essay_text()[: length * 8], add_special_tokens=False)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        return torch.tensor([ids[:length]], device=DEVICE)
    except ImportError:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, min(tokenizer.vocab_size, 30000), (1, length), generator=g).to(DEVICE)


# capture and replay of a prefill: the toolkit evaluation/ uses (evaluation/capture.py) -----------------------
OBS_WINDOW = 64  # rows of each layer's attention input a capture keeps: the window queries' (obs_window)


def capture_prefill(model, ids: torch.Tensor) -> tuple[Captured, float]:
    """One plain prefill with every layer's codec inputs kept (`evaluation.capture.capture`, wall clock).
    Returns (the capture, the prefill's wall seconds including the capture's copies)."""
    captured = capture(model, ids, timer=clock, hidden_tail=OBS_WINDOW)
    return captured, captured.seconds


def replay_into(cache, model, captured: Captured, hook=None) -> float:
    """Feed a captured prefill to `cache` as a bound model's prefill does (`evaluation.capture.replay`;
    `hook`: the library's prefill hook, by default today's). Returns the wall seconds spent in the
    VarRate layers: the query hook and the update."""
    return replay(cache, model, captured, timer=clock, hook=hook)


@dataclass
class Document:
    """One benchmark prompt: the model, its bases, the prompt ids and its captured prefill."""

    env: dict
    model: object
    tokenizer: object
    bases: object
    bases_name: str
    ids: torch.Tensor
    captured: Captured


def captured_document(name: str, dtype: str, length: int, threads: int) -> Document:
    """Set the threads, load `name` and its bases, and capture the plain prefill of a `length`-token document."""
    set_threads(threads)
    env = environment()
    model, tokenizer = load(name, dtype)
    bases, bases_name = bases_for(name, model)
    ids = document_ids(tokenizer, length)
    log(f"capturing a {length}-token prefill of {name} {dtype}")
    captured, _ = capture_prefill(model, ids)
    return Document(env, model, tokenizer, bases, bases_name, ids, captured)


def timed_forward(model, ids: torch.Tensor, cache, handles=()) -> float:
    """Wall seconds of one no-grad forward of `ids` into `cache` (last logits only), and of coding the prompt a
    VarRateCache then holds (`compress()`: what a prefill that is reused costs); the hook `handles` are
    removed afterwards, whatever happens."""
    try:
        name = cache_kwarg(model)
        start = clock()
        with torch.no_grad():
            model(ids, logits_to_keep=1, **{name: cache})
            if hasattr(cache, "compress"):
                cache.compress()
        return clock() - start
    finally:
        for handle in handles:
            handle.remove()


# timing and statistics -----------------------------------------------------------------------------------------
def timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = clock()
    out = fn(*args, **kwargs)
    return clock() - start, out


def summary(samples: list[float]) -> dict:
    """Median, min, max and relative spread ((max - min) / median) of repeated measurements."""
    if not samples:
        return {"n": 0}
    med = statistics.median(samples)
    return {"n": len(samples), "median": med, "min": min(samples), "max": max(samples),
            "spread": (max(samples) - min(samples)) / med if med else 0.0, "samples": samples}


def fit_exponent(lengths: list[int], seconds: list[float]) -> float | None:
    """Least-squares slope of log(seconds) on log(length): time ~ length ** slope."""
    import math

    points = [(math.log(n), math.log(t)) for n, t in zip(lengths, seconds) if t > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


# output ----------------------------------------------------------------------------------------------------------
def write_results(name: str, data: dict, markdown: str) -> None:
    """benchmarks/runs/<name>.json and .md (`name` may hold a subfolder: gpu/decode)."""
    (RESULTS / name).parent.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown.rstrip() + "\n")
    print(markdown)


def table(header: list[str], rows: list[list]) -> str:
    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
