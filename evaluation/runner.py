"""The evaluation loop: per example one captured prefill, then every method in every regime.

Results are appended to `examples.jsonl` one row per (example, regime, method) as soon as they
exist; a rerun skips rows already there (resumable). A method that cannot run on a model (e.g.
kvpress's KVzip on Gemma-3) is recorded once in `unsupported.json` and skipped for that model.
Each stage a process runs is locked in the output (`stage-<i>.lock`, POSIX) for as long as the process runs, so
two processes can share an output only with disjoint stages: a second process on a running stage is refused
before it evaluates anything, where it would have appended a second copy of every row.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_varrate.models import DEFAULT_MODELS, load_default_model

from .capture import capture, full_attention_layers
from .config import EvalConfig, Stage
from .footprint import per_layer_bytes
from .generate import answer_nll, continuation_nll, greedy_answer
from .methods import Context, Unsupported, make_method
from .methods.base import dynamic_from_capture
from .prompts import encode
from .tasks import build_examples, score

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None

log = logging.getLogger("evaluation")


class StageBusy(RuntimeError):
    """Another process is running a stage this one was asked to run, into the same output."""


def open_locked(path: Path, wait: bool = True):
    """`path` opened for appending under an exclusive lock (POSIX flock; none elsewhere), released when the file
    is closed or its process ends. wait=False: BlockingIOError at once if another open file holds it."""
    lock = open(path, "a+")
    try:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        lock.close()
        raise
    return lock


def row_key(row: dict) -> tuple:
    return (row["model"], row["example_id"], row["regime"], row["method"])


def load_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Runner:
    def __init__(self, config: EvalConfig, out_dir: Path, on_progress=None):
        self.config, self.out = config, out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows_path = self.out / "examples.jsonl"
        self.done = {row_key(r) for r in load_rows(self.rows_path)}
        self.unsupported_path = self.out / "unsupported.json"
        self.unsupported = json.loads(self.unsupported_path.read_text()) if self.unsupported_path.is_file() else {}
        self.on_progress = on_progress or (lambda: None)
        self._model_name, self._model = None, None

    def run(self, max_examples: int | None = None, stages: list[int] | None = None) -> None:
        """Run (or resume) every stage, or only the `stages` at these indices of the config's list, at the
        config's thread count; the caller's thread count comes back afterwards."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.config.threads)
        try:
            with contextlib.ExitStack() as locks:
                for i in range(len(self.config.stages)) if stages is None else stages:
                    locks.enter_context(self.stage_lock(i))
                self._run(max_examples, stages)
        finally:
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def stage_lock(self, index: int):
        """Hold stage `index` of this output for this process (the lock file records its pid); StageBusy if
        another process holds it. The lock goes with the process, however it ends."""
        path = self.out / f"stage-{index}.lock"
        try:
            lock = open_locked(path, wait=False)
        except BlockingIOError:
            holder = path.read_text().strip() or "another process"
            raise StageBusy(f"stage {index} is being run into {self.out} by process {holder}; wait for it to end, "
                            f"or pass --stages without {index} to run other stages beside it") from None
        with lock:
            lock.truncate(0)
            lock.write(str(os.getpid()))
            lock.flush()
            yield

    def _run(self, max_examples: int | None, stages: list[int] | None) -> None:
        count = 0
        for i, stage in enumerate(self.config.stages):
            if stages is not None and i not in stages:
                continue
            self.wait_for_bases(stage)
            total = stage.n * len(stage.lengths) * len(stage.tasks)  # at most: a task may have fewer examples
            with tqdm(self.stage_examples(stage), total=total, desc=f"stage {i} ({stage.model})", unit="example",
                      mininterval=10, dynamic_ncols=True) as examples:
                for example in examples:
                    todo = self.todo(stage, example)
                    if not todo:
                        continue  # done in an earlier run
                    self.evaluate(stage, example, todo)
                    count += 1
                    if count % self.config.report_every == 0:
                        self.on_progress()
                    if max_examples is not None and count >= max_examples:
                        return

    def wait_for_bases(self, stage: Stage) -> None:
        """Shipped bases may still be being built by their owner: poll for them (config: wait_for_bases_s)."""
        from .methods.varrate import shipped_bases

        uses = any(self.config.methods[m]["kind"] == "varrate" and self.config.methods[m].get("bases", stage.bases)
                   == "shipped" for m in stage.methods)
        folder = shipped_bases() / stage.model
        deadline = time.time() + self.config.wait_for_bases_s
        while uses and not ((folder / "bases.safetensors").is_file() and (folder / "config.json").is_file()):
            if time.time() > deadline:
                return  # each varrate row then fails with the loader's message, recorded in errors.jsonl
            log.info("waiting for shipped bases in %s", folder)
            time.sleep(60)

    def model(self, name: str):
        if self._model_name != name:
            self._model, self._model_name = load_default_model(name), name
        return self._model

    def stage_examples(self, stage: Stage):
        model, tokenizer = self.model(stage.model)
        chat = DEFAULT_MODELS[stage.model].chat_template if stage.chat is None else stage.chat
        groups = [build_examples(task, tokenizer, chat, length, stage.n, **stage.task_options.get(task, {}))
                  for length in stage.lengths for task in stage.tasks]
        for i in range(stage.n):  # interleaved: every cell grows together
            for group in groups:
                if i < len(group):
                    yield group[i]

    def todo(self, stage: Stage, example) -> list[tuple[str, str]]:
        regimes = ["query_agnostic"] if example.metric == "nll" else stage.regimes
        skip = set(self.unsupported.get(stage.model, {}))
        return [(regime, m) for regime in regimes for m in stage.methods
                if m not in skip and (stage.model, example.example_id, regime, m) not in self.done]

    def evaluate(self, stage: Stage, example, todo) -> None:
        model, tokenizer = self.model(stage.model)
        seg = example.segments
        captured = capture(model, seg.context + seg.question)
        for regime in dict.fromkeys(r for r, _ in todo):
            ids = seg.compressed(regime)
            sub = captured.prefix(len(ids))
            full = per_layer_bytes(dynamic_from_capture(model, sub))
            for name in [m for r, m in todo if r == regime]:
                row = self.run_method(stage, example, regime, name, ids, sub, full)
                if row is not None:
                    self.append(row)

    def run_method(self, stage, example, regime, name, ids, sub, full) -> dict | None:
        model, tokenizer = self.model(stage.model)
        spec = self.config.methods[name]
        method = self.method(name)
        ctx = Context(model, tokenizer, stage.model, sub, ids)
        try:
            comp = method.compress(ctx, stage.bases) if spec["kind"] == "varrate" else method.compress(ctx)
        except Unsupported as err:
            self.mark_unsupported(stage.model, name, str(err))
            return None
        except Exception:  # one failing method must not stop the run: record it and go on
            self.record_error(stage.model, example.example_id, regime, name, traceback.format_exc())
            return None
        layer_bytes = per_layer_bytes(comp.cache, comp.masks)
        for i, stored in comp.extra.pop("stored_bytes", {}).items():
            layer_bytes[i] = stored
        tail = example.segments.fed_after(regime)
        if example.metric == "nll":
            nll, count = continuation_nll(model, comp.cache, comp.masks, tail, len(ids), copy_cache=False)
            result = {"score": nll / count, "nll_sum": nll, "nll_tokens": count}
        else:
            result = {}
            if self.config.answer_nll:  # before the greedy answer, which reads the cache itself, not a copy
                answer = encode(tokenizer, " " + example.answers[0])
                result["answer_nll"] = answer_nll(model, comp.cache, comp.masks, tail, answer, len(ids))
            prediction = greedy_answer(model, tokenizer, comp.cache, comp.masks, tail, len(ids), example.max_new_tokens,
                                       copy_cache=False)  # one question per compressed prompt: no copy needed
            result.update(score=score(example.metric, prediction, example.answers), prediction=prediction,
                          answers=example.answers)
        return self.row(stage, example, regime, name, spec, sub, full, layer_bytes, comp, result)

    def row(self, stage, example, regime, name, spec, sub, full, layer_bytes, comp, result) -> dict:
        model = self.model(stage.model)[0]
        attn = full_attention_layers(model)
        return {
            "config": self.config.name, "model": stage.model, "task": example.task, "example_id": example.example_id,
            "regime": regime, "method": name, "kind": spec["kind"], "budget": spec.get("budget"),
            "metric": example.metric, **example.meta, "prompt_tokens": sub.length, **result,
            "bytes": sum(layer_bytes), "full_bytes": sum(full), "fraction": sum(layer_bytes) / sum(full),
            "fraction_full_attention": sum(layer_bytes[i] for i in attn) / sum(full[i] for i in attn),
            "cpu_prefill": round(sub.seconds, 4), "cpu_compress": round(comp.seconds, 4),
            "cost": round(1.0 + comp.seconds / sub.seconds, 4), **comp.extra, "time": time.time(),
        }

    def method(self, name: str):
        cache = self.__dict__.setdefault("_methods", {})
        if name not in cache:
            cache[name] = make_method(name, self.config.methods[name])
        return cache[name]

    def append(self, row: dict) -> None:
        with self.rows_path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        self.done.add(row_key(row))

    def mark_unsupported(self, model: str, method: str, reason: str) -> None:
        log.warning("%s cannot run on %s: %s", method, model, reason)
        self.unsupported.setdefault(model, {})[method] = reason
        self.unsupported_path.write_text(json.dumps(self.unsupported, indent=2, sort_keys=True) + "\n")

    def record_error(self, model, example_id, regime, method, trace) -> None:
        log.error("%s failed on %s/%s/%s:\n%s", method, model, example_id, regime, trace)
        with (self.out / "errors.jsonl").open("a") as f:
            f.write(json.dumps({"model": model, "example_id": example_id, "regime": regime, "method": method,
                                "trace": trace}) + "\n")
