"""The evaluation-only `eval_surprisal` salience (evaluation/methods/varrate.py): what it computes, that ranks
follow it, and that it stays out of the library's signal registry unless a method spec asks for it."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods.varrate import SURPRISAL
from hf_varrate.signals import SIGNALS


def test_surprisal_is_the_models_own_next_token_nll(tiny_llama, one_intra_op_thread):
    from evaluation.methods import varrate

    ids = torch.randint(2, 128, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    spent = varrate.surprisal(tiny_llama, ids, chunk=64)  # chunks that do not divide S - 1
    got = varrate._surprisal["current"]
    varrate._surprisal["current"] = None
    with torch.no_grad():
        logp = torch.log_softmax(tiny_llama(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    want = torch.cat([torch.zeros(1), -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])
    assert got.shape == (300,) and spent >= 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_eval_surprisal_ranks_follow_the_prompts_surprisal(tiny_llama, restore_signals, one_intra_op_thread):
    from evaluation.capture import capture
    from evaluation.methods import make_method, varrate
    from evaluation.methods.base import Context
    from hf_varrate.signals import SignalInputs

    assert SURPRISAL not in SIGNALS or SIGNALS[SURPRISAL].score is varrate.surprisal_signal
    method = make_method("s", {"kind": "varrate", "preset": "recommended", "bases": "identity", "balance": "none",
                               "budget": 0.3, "signal": SURPRISAL})
    assert SURPRISAL in SIGNALS  # registered by the spec that names it
    ids = torch.randint(2, 128, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    comp = method.compress(Context(tiny_llama, None, "tiny", capture(tiny_llama, ids), ids))
    assert varrate._surprisal["current"] is None  # set only around the replay
    assert comp.extra["cpu_surprisal_head"] >= 0 and comp.seconds >= comp.extra["cpu_surprisal_head"]
    varrate.surprisal(tiny_llama, ids)
    nll = varrate._surprisal["current"]
    varrate._surprisal["current"] = None
    codes = [code for layer in comp.cache.layers for code in getattr(layer, "codes", [])]
    assert codes and not any(code.stored_exactly for code in codes)
    for code in codes:
        ranks, salience = code.ranks.long(), nll[code.coded_pos]
        assert ranks.max() > ranks.min()  # graded, not flat
        assert ranks[salience.argmax()] == ranks.max() and ranks[salience.argmin()] == ranks.min()
    # outside a replay the signal has nothing to read, and says so instead of coding with a stale prompt
    empty = SignalInputs(None, None, 1.0, torch.arange(3), 400, 16, 64, 5, 0)
    with pytest.raises(RuntimeError, match="evaluation-only"):
        varrate.surprisal_signal(empty)
