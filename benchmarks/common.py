"""Shared pieces of the benchmarks: models, prompts, capture and replay of a prefill, timing, output.

Every benchmark measures its comparisons side by side in one process (or one script run), repeats
them, and reports medians and the spread; results go to benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

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
RESULTS = REPO / "benchmarks" / "results"


# environment ---------------------------------------------------------------------------------------------
def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


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
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "native_loops": native.available(), "load_average": os.getloadavg(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


# models and prompts ------------------------------------------------------------------------------------------
def load(name: str, dtype: str = "float32"):
    from hf_varrate.models import load_default_model

    model, tokenizer = load_default_model(name, dtype=getattr(torch, dtype))
    return model.eval(), tokenizer


def bases_for(name: str, model):
    """The shipped calibrated bases for `name` if they are in hub_assets/, else the identity basis
    (the codec's cost depends only on the rank R, which is D either way for these models)."""
    from hf_varrate import Bases

    folder = REPO / "hub_assets" / name
    if (folder / "bases.safetensors").is_file():
        return Bases.from_pretrained(folder), str(folder.relative_to(REPO))
    return Bases.identity(model.config), "identity"


def document_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """[1, length] token ids of real text (the RULER haystack essays) if installed, else random ids."""
    try:
        from hf_varrate.demo import essay_text

        ids = tokenizer(essay_text()[: length * 8], add_special_tokens=False)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        return torch.tensor([ids[:length]])
    except ImportError:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, min(tokenizer.vocab_size, 30000), (1, length), generator=g)


# capture and replay of a prefill -----------------------------------------------------------------------------
@dataclass
class LayerInputs:
    """What one VarRate layer sees at the prefill: K/V, the hook's context, and the hidden tail."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scaling: float
    hidden_tail: torch.Tensor  # [1, W, hidden]: what the hook reads to recompute the window queries


def capture_prefill(model, ids: torch.Tensor, obs_window: int = 64) -> tuple[dict[int, LayerInputs], float]:
    """Run one plain prefill (DynamicCache) and keep every attention layer's codec inputs.
    Returns (inputs per layer, seconds the prefill took including the capture's copies)."""
    from transformers import DynamicCache

    from hf_varrate.binding import attention_modules, window_queries
    from hf_varrate.codec.salience import attention_scale

    contexts, kv, handles = {}, {}, []

    def before(module, args, kwargs):
        hidden = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        window = min(obs_window, hidden.shape[1])
        contexts[module.layer_idx] = (window_queries(module, hidden, cos, sin, window), cos, sin,
                                      hidden[:, -window:].clone(), attention_scale(module))

    cache = DynamicCache(config=model.config)
    update = cache.update

    def recording_update(key_states, value_states, layer_idx, *args, **kwargs):
        kv[layer_idx] = (key_states, value_states)  # the prefill's own tensors; nothing mutates them
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = recording_update
    for module in attention_modules(model):
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
    seconds = timed_forward(model, ids, cache, handles)
    captured = {i: LayerInputs(*kv[i], *contexts[i][:3], contexts[i][4], contexts[i][3]) for i in kv}
    return captured, seconds


@dataclass
class Document:
    """One benchmark prompt: the model, its bases, the prompt ids and its captured prefill."""

    env: dict
    model: object
    tokenizer: object
    bases: object
    bases_name: str
    ids: torch.Tensor
    captured: dict


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
    """Wall seconds of one no-grad forward of `ids` into `cache` (last logits only); the hook `handles`
    are removed afterwards, whatever happens."""
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, past_key_values=cache, logits_to_keep=1)
        return time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()


def replay_into(cache, captured: dict[int, LayerInputs], layers=None) -> float:
    """Feed captured prefill inputs to `cache`'s layers exactly as a real prefill does (hook context,
    then update). Returns the seconds spent in the VarRate layers' updates."""
    from hf_varrate import VarRateLayer
    from hf_varrate.binding import PrefillContext

    spent = 0.0
    with torch.no_grad():
        for i, layer in enumerate(cache.layers):
            if layers is not None and i not in layers:
                continue
            x = captured[i]
            if isinstance(layer, VarRateLayer):
                layer.prefill_context = PrefillContext(x.queries, x.cos, x.sin, x.scaling, None)
                start = time.perf_counter()
                cache.update(x.keys, x.values, i)
                spent += time.perf_counter() - start
            else:
                cache.update(x.keys, x.values, i)
    return spent


def hook_seconds(model, captured: dict[int, LayerInputs]) -> float:
    """Seconds the prefill hook spends recomputing the window queries, over all VarRate layers."""
    from hf_varrate.binding import attention_modules, window_queries

    spent = 0.0
    with torch.no_grad():
        for module in attention_modules(model):
            x = captured[module.layer_idx]
            window = x.hidden_tail.shape[1]
            start = time.perf_counter()
            window_queries(module, x.hidden_tail, x.cos[:, -window:], x.sin[:, -window:], window)
            spent += time.perf_counter() - start
    return spent


# timing and statistics -----------------------------------------------------------------------------------------
def timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


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
    RESULTS.mkdir(parents=True, exist_ok=True)
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
