"""Shared fixtures: tiny random models built offline (fast), and the real default models (slow).

Tiny models are function-scoped, so hooks or state one test leaves on a model never reach
another. The real models are session-scoped because loading them takes seconds; a test that binds
one must unbind it (try/finally or the library's context manager). Every test that uses a real
model is marked ``slow`` automatically: ``pytest -m "not slow"`` skips them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
)

from hf_varrate.models import load_default_model

REAL_MODEL_FIXTURES = ("smollm2", "gemma3")

# One shape for every tiny model: H = 2 kv heads, Hq = 4 query heads, d = 16, so D = 2*H*d = 64.
# No eos_token_id: greedy generation always runs to max_new_tokens, so token-by-token
# comparisons between caches compare the same number of tokens.
TINY_SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)

TINY_GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TINY_GEMMA3_SLIDING_WINDOW = 16


def pytest_configure(config):
    torch.set_num_threads(2)  # the CI machine has 2 cores, shared


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in REAL_MODEL_FIXTURES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def one_intra_op_thread():
    """Tiny models' ops take microseconds: on a shared 2-core machine a second OpenMP thread only
    spins (about 10x slower). Restored afterwards. Used by the robustness files via pytestmark."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def restore_signals():
    """Signals a test registers (the evaluation-only ones a method spec names) leave the registry afterwards:
    other test files parametrize over it."""
    from hf_varrate.signals import SIGNALS

    before = set(SIGNALS)
    yield
    for name in set(SIGNALS) - before:
        SIGNALS.pop(name)


def _build_tiny(config: PretrainedConfig) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


@pytest.fixture
def tiny_llama() -> PreTrainedModel:
    """Random 2-layer LlamaForCausalLM (no q/k norm, plain RoPE)."""
    return _build_tiny(LlamaConfig(**TINY_SHAPE))


@pytest.fixture
def tiny_qwen3() -> PreTrainedModel:
    """Random 2-layer Qwen3ForCausalLM (q_norm / k_norm before RoPE)."""
    return _build_tiny(Qwen3Config(**TINY_SHAPE))


@pytest.fixture
def tiny_gemma3() -> PreTrainedModel:
    """Random 4-layer Gemma3ForCausalLM, sliding (window 16) and full attention layers alternating."""
    shape = {**TINY_SHAPE, "num_hidden_layers": len(TINY_GEMMA3_LAYER_TYPES)}
    config = Gemma3TextConfig(
        **shape,
        layer_types=TINY_GEMMA3_LAYER_TYPES,
        sliding_window=TINY_GEMMA3_SLIDING_WINDOW,
        query_pre_attn_scalar=TINY_SHAPE["head_dim"],
    )
    return _build_tiny(config)


def _load_real(name: str):
    try:
        model, tokenizer = load_default_model(name)
    except ImportError as err:  # the message carries the pip command
        pytest.skip(str(err))
    torch.manual_seed(0)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct: 30 layers, Hq 9, H 3, d 64; chat template."""
    return _load_real("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) for Gemma-3-270M (base): 18 layers, 3 of them full attention, H 1, d 256."""
    return _load_real("gemma-3-270m")
