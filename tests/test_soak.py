"""Long reuse and concurrency: compress once, ask many times; two caches on one model from two threads.

CI variant: 200 question/answer cycles on deep copies of one compressed cache on a tiny random
Llama (100 in compact storage, which reconstructs the prompt at every read; seconds). Long variant,
on SmolLM2-135M-Instruct with its shipped bases and a ~2K-token document (minutes on CPU):

    HF_VARRATE_SOAK=1 pytest tests/test_soak.py -k smollm2 -s

Each checks: the answers to one question are identical in every cycle (and equal to a fresh
compress-then-ask), the original compressed cache is unchanged tensor for tensor, and memory is
flat: the bytes of live tensors do not grow at all after the warm-up, and the process RSS grows by
no more than allocator noise. The last result is in docs/bad_inputs.md.
"""

from __future__ import annotations

import copy
import gc
import os
import threading
from pathlib import Path

import pytest
import torch

import hf_varrate
from hf_varrate import Bases, VarRateCache

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2)
WARMUP = 20  # cycles before memory is measured: allocator pools and lazy tables settle
RSS_NOISE = 48 << 20  # RSS growth tolerated after the warm-up (glibc arenas, torch caches), plus two copies


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# --- measuring ----------------------------------------------------------------------------------------
def live_tensor_bytes() -> int:
    """Bytes of every distinct storage behind a live torch.Tensor (parameters included)."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu" and not is_fake(obj):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def is_fake(tensor) -> bool:
    """A tensor with no data of its own (torch.compile's fake tensors, which an earlier compiled test in the same
    process may leave for the garbage collector): it holds no memory to count."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or type(tensor).__name__ == "FunctionalTensor"


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; falls back to the peak from `resource`)."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def snapshot(cache) -> list[torch.Tensor]:
    """Clones of every tensor a cache holds: K/V, codes, exact tokens."""
    held = []
    for layer in cache.layers:
        held += [t.clone() for t in (layer.keys, layer.values) if t is not None]
        for code in getattr(layer, "codes", []):
            held += [t.clone() for t in code.held_tensors()]
    return held


def assert_unchanged(cache, before: list[torch.Tensor], length: int) -> None:
    after = snapshot(cache)
    assert len(after) == len(before) and cache.get_seq_length() == length
    for a, b in zip(after, before):
        assert a.dtype == b.dtype and torch.equal(a, b)


def ask(model, cache, ids, new, pad):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                             do_sample=False, pad_token_id=pad)
    return out[0, ids.shape[1]:].tolist()


def soak(model, base, doc, questions, cycles, new=4, pad=0, log=None):
    """Ask questions[i % len] of deep copies of `base` (which holds `doc`) `cycles` times; check answers,
    the original and memory. Returns a summary dict."""
    before, length = snapshot(base), base.get_seq_length()
    tolerance = RSS_NOISE + 2 * sum(t.numel() * t.element_size() for t in before)  # a freed copy may stay mapped
    answers = {}
    tensor_mem, rss = [], []
    for cycle in range(cycles):
        i = cycle % len(questions)
        got = ask(model, copy.deepcopy(base), torch.cat([doc, questions[i]], dim=1), new, pad)
        assert answers.setdefault(i, got) == got, f"cycle {cycle}: question {i} answered {got}, first {answers[i]}"
        if cycle + 1 == WARMUP or (cycle + 1 > WARMUP and (cycle + 1) % 50 == 0) or cycle + 1 == cycles:
            tensor_mem.append(live_tensor_bytes())
            rss.append(rss_bytes())
            if log:
                log(f"cycle {cycle + 1}: live tensors {tensor_mem[-1] / 2**20:.2f} MiB, RSS {rss[-1] / 2**20:.1f} MiB")
    assert_unchanged(base, before, length)
    assert tensor_mem == [tensor_mem[0]] * len(tensor_mem), f"live tensor bytes grew: {tensor_mem}"
    assert rss[-1] - rss[0] <= tolerance, f"RSS grew by {(rss[-1] - rss[0]) / 2**20:.1f} MiB: {rss}"
    return {"answers": answers, "tensor_bytes": tensor_mem, "rss": rss, "rss_tolerance": tolerance}


# --- CI: tiny model -----------------------------------------------------------------------------------
def tokens(model, length, seed):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def tiny_cache(model, storage):
    hf_varrate.bind(model)
    return VarRateCache(Bases.identity(model.config), model=model, budget=0.3, storage=storage, **SMALL)


@pytest.mark.parametrize("storage, cycles", [("materialized", 200), ("compact", 100)])  # compact decodes per read
def test_soak_cycles_on_copies_are_deterministic_flat_and_leave_the_original_alone(tiny_llama, storage, cycles):
    doc = tokens(tiny_llama, 400, seed=0)  # any leaked tensor shows in the live-tensor bytes, whatever its size
    questions = [tokens(tiny_llama, 6, seed=s) for s in (1, 2, 3, 4)]
    base = tiny_cache(tiny_llama, storage)
    with torch.no_grad():
        tiny_llama(doc, past_key_values=base)
        base.compress()
    assert not base.layers[0].codes[0].stored_exactly
    result = soak(tiny_llama, base, doc, questions, cycles)
    for i, q in enumerate(questions):  # a copy answers as a cache compressed afresh
        fresh = tiny_cache(tiny_llama, storage)
        with torch.no_grad():
            tiny_llama(doc, past_key_values=fresh)
            fresh.compress()
        assert ask(tiny_llama, fresh, torch.cat([doc, q], dim=1), 4, 0) == result["answers"][i]


def test_two_caches_on_one_bound_model_from_two_threads_answer_as_sequentially(tiny_llama):
    docs = [tokens(tiny_llama, 600, seed=10 + t) for t in range(2)]
    questions = [[tokens(tiny_llama, 5, seed=20 + 3 * t + k) for k in range(3)] for t in range(2)]

    def session(t, barrier=None):
        cache = tiny_cache(tiny_llama, "materialized")
        if barrier is not None:
            barrier.wait()  # both prefills (and so both hooks) run at once
        with torch.no_grad():
            tiny_llama(docs[t], past_key_values=cache)
            cache.compress()
        return [ask(tiny_llama, copy.deepcopy(cache), torch.cat([docs[t], q], dim=1), 6, 0) for q in questions[t]]

    sequential = [session(0), session(1)]
    for _ in range(3):
        results, errors = [None, None], []
        barrier = threading.Barrier(2)

        def run(t):
            try:
                results[t] = session(t, barrier)
            except BaseException as exc:  # surfaced below, with its thread
                errors.append((t, exc))

        threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        assert results == sequential


# --- long: SmolLM2 ------------------------------------------------------------------------------------
@pytest.mark.skipif(os.environ.get("HF_VARRATE_SOAK") != "1", reason="long soak: set HF_VARRATE_SOAK=1")
def test_soak_smollm2_with_shipped_bases(smollm2):
    from hf_varrate.demo import DEPTHS, FACTS, chat_parts, essay_text, plant

    model, tokenizer = smollm2
    cycles = int(os.environ.get("HF_VARRATE_SOAK_CYCLES", "200"))
    text = plant(essay_text(), tokenizer, 2000, [f[0] for f in FACTS], DEPTHS)
    parts = [chat_parts(tokenizer, text, question, lead) for _, question, _, lead in FACTS]
    doc = torch.tensor([parts[0][0]])
    questions = [torch.tensor([q]) for _, q in parts]
    try:
        base = VarRateCache.from_pretrained("smollm2-135m-instruct", model=model)
        with torch.no_grad():
            model(doc, past_key_values=base)
            base.compress()
        result = soak(model, base, doc, questions, cycles, new=10, pad=tokenizer.eos_token_id, log=print)
    finally:
        hf_varrate.unbind(model)
    texts = [tokenizer.decode(result["answers"][i]) for i in range(len(questions))]
    rss = [(r - result["rss"][0]) / 2**20 for r in result["rss"]]
    print(f"doc {doc.shape[1]} tokens, {cycles} cycles, footprint {base.footprint().fraction:.4f}, live tensor "
          f"bytes {result['tensor_bytes'][0]} at every checkpoint, RSS vs warm-up {[round(r) for r in rss]} MiB "
          f"(tolerance {result['rss_tolerance'] / 2**20:.0f} MiB), answers {texts}")
