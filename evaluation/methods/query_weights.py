"""Keys weighted by what the queries read (`eval_query_weights: alpha`, evaluation only, a hypothesis).

The codec's PCA and its anchors minimise the coding error of z_t = [k~_t ; v_t] in one metric for every key
dimension. But a key's error reaches attention only through q . e: a dimension the queries barely read can
take more error than one they read heavily. Here the key half of z is scaled, per KV head and dimension, by
w = m^(alpha / 2), where m is the queries' mean energy in that dimension (pre-RoPE, summed over the query
heads that share the KV head, averaged over each RoPE pair since the rotation mixes its two dimensions),
measured on calibration text the evaluation never scores. alpha = 1 minimises the expected logit error for
independent errors; 0 is the library. The weights are rescaled so the key half keeps its calibration energy
(the key/value balance stays the preset's), and the coding basis becomes the top eigenbasis of the rescaled
calibration moment (`codec.balance.balanced_basis(key_scales=)`).

Attention over the codes (`storage="compact"`) reads the key half unscaled, so a method with this option must
set `storage: materialized` (the decoder divides every scale out before attention sees the keys).
"""

from __future__ import annotations

import types

import torch

from hf_varrate.calibration.contexts import build_contexts
from hf_varrate.calibration.texts import wiki_documents
from hf_varrate.codec.balance import balanced_basis
from hf_varrate.spaces import CodingCopy, DerivedCopies

from ..capture import capture, decoder, full_attention_layers

CONTEXTS = 2  # calibration contexts the query energy is measured on
LENGTH = 2048  # tokens each


def calibration_contexts(tokenizer, contexts: int = CONTEXTS, length: int = LENGTH) -> list[list[int]]:
    """The token ids of `contexts` calibration texts (the wiki calibration split) of `length` tokens each."""
    return [ids.view(-1).tolist() for ids in build_contexts(tokenizer, wiki_documents("calibration"), contexts, length)]


def pre_rope_queries(module, hidden: torch.Tensor) -> torch.Tensor:
    """[1, H_q, S, d]: an attention module's queries of `hidden` [1, S, hidden] before RoPE (Gemma-3 normalises
    them first)."""
    q = module.q_proj(hidden).view(1, hidden.shape[1], -1, module.head_dim).transpose(1, 2)
    return module.q_norm(q) if hasattr(module, "q_norm") else q


def query_energy(model, contexts: list[list[int]]) -> dict[int, torch.Tensor]:
    """{full-attention layer: [H_kv, d] fp64} the queries' mean energy per KV head and key dimension over the
    prompts `contexts` (pre-RoPE, summed over each KV head's query heads, each RoPE pair's two dimensions
    averaged)."""
    attention = {layer.self_attn.layer_idx: layer.self_attn for layer in decoder(model).layers}
    energy: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for ids in contexts:
            captured = capture(model, ids)
            for i in full_attention_layers(model):
                q = pre_rope_queries(attention[i], captured.hidden[i])
                energy[i] = energy.get(i, 0) + q[0].double().square().mean(dim=1) / len(contexts)  # [H_q, d]
    kv_heads = captured.keys[0].shape[1]
    out = {}
    for i, m in energy.items():
        heads, dim = m.shape
        m = m.view(kv_heads, heads // kv_heads, dim).sum(dim=1)
        pair = (m[:, : dim // 2] + m[:, dim // 2 :]) / 2  # rotate_half's pairs (j, j + d/2)
        out[i] = torch.cat((pair, pair), dim=1)
    return out


def key_weights(energy: torch.Tensor, alpha: float, key_moment: torch.Tensor) -> torch.Tensor:
    """[H_kv * d] fp64: energy^(alpha / 2), floored at 1% of its mean (a dimension no query reads still decodes),
    rescaled so sum(w^2 * key_moment) = sum(key_moment)."""
    w = energy.reshape(-1).pow(alpha / 2)
    w = w.clamp(min=float(w.mean()) * 1e-2)
    return w * (key_moment.sum() / (w.square() * key_moment).sum()).sqrt()


def apply(bases, model, tokenizer, alpha: float) -> None:
    """Make `bases` (a copy of its own: its derived coding copies change) code in the query-weighted space,
    the queries' energy measured on the calibration split."""
    weigh(bases, query_energy(model, calibration_contexts(tokenizer)), alpha)


def weigh(bases, energy: dict[int, torch.Tensor], alpha: float) -> None:
    """Make `bases` derive its coding copies with the key half weighted by `energy` ({layer: [H_kv, d]})."""
    spaces = bases.spaces

    def weighted_copy(self, key, basis):
        layer_idx, _, balance, key_weight, _ = key
        spectrum = self.bases.spectrum(layer_idx)
        half = basis.shape[1] // 2
        key_moment = (basis[:, :half].double().square() * spectrum.double().square()[:, None]).sum(dim=0).cpu()
        w = key_weights(energy[layer_idx], alpha, key_moment)
        weighted, scales, _ = balanced_basis(basis.float(), spectrum, balance, key_weight, key_scales=w)
        return CodingCopy(weighted.to(basis.dtype), scales, None)

    spaces._balanced_copy = types.MethodType(weighted_copy, spaces)
    spaces._copies = DerivedCopies()  # its own: bases of equal content share their derived copies
