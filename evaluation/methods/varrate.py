"""VarRate through the library's own path: a VarRateCache fed layer by layer.

For each full-attention layer we call the library's prefill hook exactly as a bound attention
module would (it computes the window queries from the layer's input, cos/sin and the module), then
`cache.update(keys, values)`, which compresses. `impl: press` runs hf_varrate.press.VarRatePress
(the kvpress adapter) instead, through kvpress's forward_hook. Any VarRateConfig field may be given
in the method spec (budget, signal, allocation, r_min, stride, ...), so new codec options need no
harness change. The config comes from `Bases.config`: a spec without `preset:` is the paper preset with
the bases' calibrated stride/window/n_anchors and the spec's fields on top; `preset: recommended` starts
from that preset instead.

`eval_query_weights: alpha` (evaluation only) codes the keys weighted by the queries' energy per dimension;
see `query_weights`.

`eval_energy_value_weight: w` (evaluation only, with `allocation: distortion`) ranks by coefficient energy with
the value half weighted by w (0: the keys' alone); see `key_energy`.

`eval_keys_bits: b` (evaluation only, with `eval_keys_group: G`) quantizes the coded tokens' keys per channel
beside values coded low-rank, within the spec's budget; see `kivi_keys`.

`eval_read_keys: p` (evaluation only, with `eval_read_stride: s`) puts back the exact keys of the p most read
tokens of each layer (H2O's heavy hitters, from the prompt's own queries), within the spec's budget; see `read_keys`.

`eval_novel_keys: p` (evaluation only, with `eval_novel_window: k`) does the same for the tokens of the sentences
that differ most from their neighbours in their values; see `novel_keys`.

`signal: eval_surprisal` (evaluation only, not a library signal) feeds the codec a salience the cache
cannot see: each prompt token's surprisal -log p(token | earlier tokens) under the model, from an extra
forward over the compressed prompt; see `surprisal`.

`signal: eval_novelty` (evaluation only, with `eval_novel_share: p` and `eval_novel_window: k`) is 1 on the tokens
of the most novel sentences (`novel_keys.most_novel`, up to p of the prompt) and 0 elsewhere, so water-filling gives
them the rank the rest give up: with the library's `flat_floor: f` every other token keeps f x the flat rank, and
the sentences share the remaining (1 - f) of the coefficient budget on top of theirs (f = 0.97, p = 0.05: about
1.6x the flat rank for 3% of the budget, against 12.5% for their exact keys). Within the budget by construction.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch

from hf_varrate import Bases, VarRateCache, VarRateConfig
from hf_varrate.errors import CalibrationOverrideWarning
from hf_varrate.shipped import SHIPPED_ROOT
from hf_varrate.signals import SIGNALS, SignalInputs, register_signal

from ..capture import clock, decoder, replay
from .base import Compressed, Context, dynamic_from_capture

NOT_CONFIG = {"kind", "bases", "impl", "preset", "layer_scales", "eval_coefs", "eval_token_group", "eval_query_weights",
              "eval_energy_value_weight", "eval_keys_bits", "eval_keys_group", "eval_read_keys", "eval_read_stride",
              "eval_novel_keys", "eval_novel_window", "eval_novel_share"}
EXACT_KEYS = {"eval_read_keys": "read", "eval_novel_keys": "novel"}  # spec field -> the extra fields' infix
SURPRISAL = "eval_surprisal"  # registered (once) when a method spec names it; never by importing this module
_surprisal: dict = {"current": None}  # the surprisal [S] of the prompt being coded, set only around its replay
NOVELTY = "eval_novelty"  # the same: registered only by a spec that names it
_novel: dict = {"current": None}  # (S, the most novel sentences' positions) of the prompt being coded, the same


def shipped_bases() -> Path:
    """Where the shipped bases live: those of the hf_varrate that is imported (so a second checkout running the
    evaluation against an installed library never pairs its code with other bases), or $HF_VARRATE_SHIPPED_BASES."""
    return Path(os.environ.get("HF_VARRATE_SHIPPED_BASES", SHIPPED_ROOT))


def resolve_bases(model, model_name: str, which: str) -> Bases:
    """'identity', 'shipped' (hf_varrate/shipped_bases/<model>/) or a directory / Hub repo id."""
    if which == "identity":
        return Bases.identity(model.config)
    path = shipped_bases() / model_name if which == "shipped" else which
    bases = Bases.from_pretrained(str(path))
    bases.validate(model.config)
    return bases


class VarRateMethod:
    kind = "varrate"

    def __init__(self, name: str, spec: dict):
        self.name, self.spec = name, spec
        self.overrides = {k: v for k, v in spec.items() if k not in NOT_CONFIG}
        if self.overrides.get("signal") in (SURPRISAL, NOVELTY):
            register_eval_signal(self.overrides["signal"])
        if (self.overrides.get("signal") == NOVELTY) != ("eval_novel_share" in spec):
            raise ValueError(f"method {name!r}: signal: {NOVELTY} and eval_novel_share go together (the share of the "
                             f"prompt's tokens, in the most novel sentences, that the signal marks); give both, "
                             f"e.g. eval_novel_share: 0.05 with flat_floor: 0.97")
        if "eval_novel_share" in spec:
            if not 0 < float(spec["eval_novel_share"]) < 1:
                raise ValueError(f"method {name!r}: eval_novel_share={spec['eval_novel_share']!r} is a share of the "
                                 f"prompt's tokens; give one in (0, 1), e.g. 0.05")
            clash = sorted({"eval_keys_bits", *EXACT_KEYS} & set(spec))
            if clash:
                raise ValueError(f"method {name!r}: signal: {NOVELTY} moves rank, which {clash} would override "
                                 f"with exact or quantized keys; drop one of them")
            if spec.get("impl", "cache") != "cache":
                raise ValueError(f"method {name!r}: signal: {NOVELTY} is set for the library's cache path alone, "
                                 f"got impl: {spec['impl']!r}; use impl: cache (the default)")
        known = set(VarRateConfig.__dataclass_fields__)
        unknown = sorted(set(self.overrides) - known)
        if unknown:  # a typo must not silently run the defaults under a new name
            raise ValueError(f"method {name!r}: {unknown} are not VarRateConfig fields (nor kind/bases/impl); "
                             f"known fields: {sorted(known)}")
        self.impl = spec.get("impl", "cache")
        if "eval_query_weights" in spec and spec.get("storage") != "materialized":
            raise ValueError(f"method {name!r}: eval_query_weights needs storage: materialized (attention over the "
                             f"codes reads the key half unscaled); add it to the spec")
        if "eval_energy_value_weight" in spec and self.overrides.get("allocation") != "distortion":
            raise ValueError(f"method {name!r}: eval_energy_value_weight weighs the energy allocation='distortion' "
                             f"ranks by; add allocation: distortion to the spec")
        if "eval_keys_bits" in spec:
            needs = {"storage": "materialized", "budget_dtype": "float16"}
            missing = {k: v for k, v in needs.items() if self.overrides.get(k) != v}
            if missing or "key_weight" not in spec or self.impl != "cache" or "budget" not in spec:
                raise ValueError(f"method {name!r}: eval_keys_bits rewrites the keys of a materialized cache within a "
                                 f"budget counted in fp16, and the codec must be told how little to weigh the keys; "
                                 f"the spec needs {needs}, a key_weight (e.g. 0.01), a budget and impl: cache")
        for field in EXACT_KEYS:
            if field not in spec:
                continue
            needs = {"storage": "materialized", "budget_dtype": "float16"}
            missing = {k: v for k, v in needs.items() if self.overrides.get(k) != v}
            others = sorted({"eval_keys_bits", *EXACT_KEYS} - {field} & set(spec))
            if missing or self.impl != "cache" or "budget" not in spec or others:
                raise ValueError(f"method {name!r}: {field} puts exact keys into a materialized cache within a "
                                 f"budget counted in fp16; the spec needs {needs}, a budget and impl: cache, and "
                                 f"none of {others}")
            if not 0 < float(spec[field]) < 1:
                raise ValueError(f"method {name!r}: {field}={spec[field]!r} is the share of the "
                                 f"prompt's tokens whose keys are put back exact; give one in (0, 1), e.g. 0.02")
        self._bases: dict[tuple[str, str], Bases] = {}  # by (model, which): one run may switch models

    def config_for(self, bases: Bases, **fields) -> VarRateConfig:
        """`bases.config(preset, **fields)`: the spec's preset ('paper' when it names none), the bases'
        calibrated stride/window/n_anchors, then the spec's fields, then `fields`."""
        with warnings.catch_warnings():  # a spec that sets stride/window/n_anchors means to: an ablation
            warnings.filterwarnings("ignore", category=CalibrationOverrideWarning)
            return bases.config(self.spec.get("preset", "paper"), **{**self.overrides, **fields})

    def bases(self, ctx: Context, default: str) -> Bases:
        key = (ctx.model_name, self.spec.get("bases", default))
        if key not in self._bases:
            self._bases[key] = resolve_bases(ctx.model, *key)
            if "layer_scales" in self.spec:  # experimental: measured per-layer budget scales (layer_sensitivity.py)
                with open(self.spec["layer_scales"]) as f:
                    scales = {int(i): float(s) for i, s in json.load(f)["scales"].items()}
                self._bases[key].layer_share = lambda i, config, kv_dtype=None, scales=scales: scales[i]
            if "eval_query_weights" in self.spec:  # experimental: keys weighted by the queries' energy
                from .query_weights import apply
                apply(self._bases[key], ctx.model, ctx.tokenizer, float(self.spec["eval_query_weights"]))
        return self._bases[key]

    def _ranks(self):
        """The allocation's energy as the spec weighs it (`key_energy`), or the library's."""
        if "eval_energy_value_weight" not in self.spec:
            return contextlib.nullcontext()
        from .key_energy import key_energy
        return key_energy(float(self.spec["eval_energy_value_weight"]))

    def compress(self, ctx: Context, default_bases: str = "shipped") -> Compressed:
        bases = self.bases(ctx, default_bases)
        config = self.config_for(bases)
        start = clock()
        if self.impl == "press":
            from .kvpress_methods import replay_press
            from hf_varrate.press import VarRatePress

            press = VarRatePress(bases=bases, config=config)
            with self._ranks():
                cache = replay_press(press, ctx, dynamic_from_capture(ctx.model, ctx.captured))
            seconds = clock() - start
            return Compressed(cache, seconds, extra={"stored_bytes": press.layer_bytes()})
        if "eval_keys_bits" in self.spec:
            return self._compress_with_quantized_keys(ctx, bases, config, start, default_bases)
        if EXACT_KEYS.keys() & self.spec.keys():
            return self._compress_with_exact_keys(ctx, bases, config, start, default_bases)
        extra = {}
        if config.signal == SURPRISAL:  # the extra forward is not counted: the library would reuse the prefill's
            head_seconds = surprisal(ctx.model, ctx.ids)  # final hidden states and pay only lm_head + log-softmax
            extra["cpu_surprisal_head"] = round(head_seconds, 4)
            start = clock() - head_seconds
        if config.signal == NOVELTY:  # counted: the library would pay for it at the prefill
            from ..capture import full_attention_layers
            from .novel_keys import WINDOW, most_novel

            chosen = most_novel(ctx.tokenizer, ctx.ids, ctx.captured, full_attention_layers(ctx.model),
                                float(self.spec["eval_novel_share"]), int(self.spec.get("eval_novel_window", WINDOW)))
            _novel["current"] = (len(ctx.ids), chosen)
            extra["eval_novel_tokens"] = chosen.numel()
        cache = VarRateCache(bases, config, model_config=ctx.model.config)
        try:
            with self._ranks():
                replay(cache, ctx.model, ctx.captured)
        finally:
            _surprisal["current"] = _novel["current"] = None
        seconds = clock() - start
        if "eval_coefs" in self.spec:  # evaluation only, its time not counted: see component_bits
            from .component_bits import rewrite
            extra.update(rewrite(cache, ctx.captured, bases, config, self.spec["eval_coefs"],
                                 self.spec.get("eval_token_group", 64)))
        extra = {**extra, **rank_diagnostics(cache), **fp16_fraction(cache),
                 "bases": self.spec.get("bases", default_bases), "bases_sha256": weights_sha(bases)}
        return Compressed(cache, seconds, extra=extra)

    def _compress_with_quantized_keys(self, ctx: Context, bases: Bases, config: VarRateConfig, start: float,
                                      default_bases: str):
        """`kivi_keys`: the codec at the budget less the quantized keys' share, once more to spend what is left."""
        from .kivi_keys import rewrite_keys, share

        bits, group = int(self.spec["eval_keys_bits"]), int(self.spec.get("eval_keys_group", 64))
        codec_budget = config.budget - share(bits, group)
        if codec_budget <= 0:
            raise ValueError(f"method {self.name!r}: keys at eval_keys_bits={bits} take {share(bits, group):.3f} of "
                             f"the fp16 bytes, more than budget={config.budget}; lower the bits or raise the budget")

        def rewrite(cache):
            exact = [i for i, layer in enumerate(cache.layers)
                     if any(code.stored_exactly for code in getattr(layer, "codes", []))]
            if exact:  # a codec budget below the exact set's bytes stores the layer as it is: not the budget asked
                raise ValueError(f"method {self.name!r}: with keys at eval_keys_bits={bits} the values get "
                                 f"budget={cache.config.budget:.4f}, too little for the exact tokens, so layers "
                                 f"{exact} were stored exactly; lower the bits or raise the budget")
            return rewrite_keys(cache, ctx.captured, bits, group)

        cache, spent, held, full, codec_budget, passes = self._two_passes(ctx, bases, config, codec_budget, rewrite,
                                                                          lambda slack: slack <= 0.002)
        seconds = clock() - start
        layers = cache.footprint().layers
        stored = {i: layers[i].bytes + spent_i for i, spent_i in spent.items()}
        extra = {"stored_bytes": stored, **rank_diagnostics(cache), "fraction_fp16": held / full,
                 "eval_keys_codec_budget": codec_budget, "eval_keys_passes": passes,
                 "bases": self.spec.get("bases", default_bases), "bases_sha256": weights_sha(bases)}
        return Compressed(cache, seconds, extra=extra)

    def _two_passes(self, ctx: Context, bases: Bases, config: VarRateConfig, codec_budget: float, rewrite, close):
        """The codec at `codec_budget`, then `rewrite(cache)` -> {layer: bytes it adds}; once more with the slack
        to `config.budget` added unless `close(slack)`. Returns (cache, spent, held, full, codec_budget, passes)."""
        passes = 0
        while True:
            passes += 1
            cache = VarRateCache(bases, self.config_for(bases, budget=codec_budget), model_config=ctx.model.config)
            replay(cache, ctx.model, ctx.captured)
            spent = rewrite(cache)
            held, full = fp16_bytes(cache)
            held += sum(spent.values())
            slack = config.budget - held / full
            if passes == 2 or close(slack):
                return cache, spent, held, full, codec_budget, passes
            codec_budget += slack

    def _compress_with_exact_keys(self, ctx: Context, bases: Bases, config: VarRateConfig, start: float,
                                  default_bases: str):
        """`read_keys` / `novel_keys`: the chosen tokens' exact keys, the codec at the budget less what they take."""
        from ..capture import full_attention_layers
        from .read_keys import attention_read, key_bytes, most_read, put_back_keys, share

        field = next(f for f in EXACT_KEYS if f in self.spec)
        fraction, layers = float(self.spec[field]), full_attention_layers(ctx.model)
        if field == "eval_read_keys":
            chosen = most_read(attention_read(ctx.model, ctx.captured, layers,
                                              int(self.spec.get("eval_read_stride", 16))), fraction)
        else:
            from .novel_keys import WINDOW, choose
            chosen = choose(ctx.tokenizer, ctx.ids, ctx.captured, layers, fraction,
                            int(self.spec.get("eval_novel_window", WINDOW)))
        heads, dim = ctx.captured.keys[0].shape[1], ctx.captured.keys[0].shape[-1]
        counts = {}

        def rewrite(cache):
            counts.update(put_back_keys(cache, ctx.captured, chosen))
            return {i: key_bytes(count, heads, dim) for i, count in counts.items()}

        cache, spent, held, full, codec_budget, passes = self._two_passes(
            ctx, bases, config, config.budget - share(fraction), rewrite, lambda slack: abs(slack) <= 0.002)
        seconds = clock() - start
        footprint = cache.footprint().layers
        stored = {i: footprint[i].bytes + spent_i for i, spent_i in spent.items()}
        infix = EXACT_KEYS[field]
        extra = {"stored_bytes": stored, **rank_diagnostics(cache), "fraction_fp16": held / full,
                 f"eval_{infix}_codec_budget": codec_budget, f"eval_{infix}_passes": passes,
                 f"eval_{infix}_exact_keys": sum(counts.values()),
                 "bases": self.spec.get("bases", default_bases), "bases_sha256": weights_sha(bases)}
        return Compressed(cache, seconds, extra=extra)


def weights_sha(bases: Bases) -> str | None:
    """The first 12 hex digits of the bases tensor file's sha256 (identity bases: None)."""
    sha = bases.metadata.get("sha256")
    sha = sha.get("bases.safetensors") if isinstance(sha, dict) else sha
    return str(sha)[:12] if sha else None


def fp16_bytes(cache) -> tuple[int, int]:
    """(bytes the compressed layers would hold with K/V in fp16, `PromptCode.nbytes(kv_bytes=2)`; fp16 K/V bytes of
    the same layers)."""
    codes = [code for layer in cache.layers for code in getattr(layer, "codes", [])]
    return sum(code.nbytes(kv_bytes=2) for code in codes), sum(code.full_nbytes(kv_bytes=2) for code in codes)


def fp16_fraction(cache) -> dict:
    """What the compressed layers would hold with K/V in fp16 (`fp16_bytes`), over fp16 K/V of the same layers. The
    models run in fp32 on CPU; with `budget_dtype: float16` this is the fraction the budget was met in, and the one
    an fp16 deployment would measure."""
    held, full = fp16_bytes(cache)
    return {"fraction_fp16": held / full if full else None}


def rank_diagnostics(cache) -> dict:
    """Mean allocated rank of coded tokens by position decile (the paper's Figure 7), share at the floor."""
    sums, counts = torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    at_floor = coded = exact_layers = 0
    for layer in cache.layers:
        for code in getattr(layer, "codes", []):
            if code.stored_exactly:
                exact_layers += 1
                continue
            decile = (code.coded_pos.cpu() * 10 // code.seq_len).clamp(max=9)
            ranks = code.ranks.long().cpu().double()
            sums.index_add_(0, decile, ranks)
            counts.index_add_(0, decile, torch.ones_like(ranks))
            at_floor += int((ranks <= cache.config.r_min).sum())
            coded += ranks.numel()
    mean = [round(s / c, 2) if c else None for s, c in zip(sums.tolist(), counts.tolist())]  # None: no coded token
    return {"rank_by_decile": mean, "floor_share": at_floor / coded if coded else None,
            "layers_stored_exactly": exact_layers}


def surprisal(model, ids: list[int], chunk: int = 512) -> float:
    """Set the surprisal the `eval_surprisal` signal reads: -log p(ids[t] | ids[:t]) for each t (0 for the first
    token, an anchor anyway), from one uncompressed forward over `ids`. Returns the CPU seconds of the part a
    library would pay on top of its prefill: the vocabulary projection over the prompt's final hidden states
    and the log-softmax, chunked over tokens (the forward itself stands in for the prefill's, not counted)."""
    with torch.no_grad():
        hidden = decoder(model)(input_ids=torch.as_tensor(ids).view(1, -1)).last_hidden_state[0]  # [S, h]
        start = clock()
        target = torch.as_tensor(ids[1:])
        cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        nll = [torch.zeros(1)]
        for lo in range(0, len(ids) - 1, chunk):
            logits = model.lm_head(hidden[lo : min(lo + chunk, len(ids) - 1)]).float()
            if cap:
                logits = torch.tanh(logits / cap) * cap
            logp = torch.log_softmax(logits, dim=-1)
            nll.append(-logp.gather(1, target[lo : lo + logits.shape[0], None])[:, 0])
        spent = clock() - start
    _surprisal["current"] = torch.cat(nll)
    return spent


def surprisal_signal(x: SignalInputs) -> torch.Tensor:
    """`eval_surprisal`: the coded tokens' surprisal (set by `surprisal` for the prompt being coded), min-max."""
    from hf_varrate.codec.salience import minmax

    nll = _surprisal["current"]
    if nll is None or nll.numel() != x.seq_len:
        raise RuntimeError(f"signal {SURPRISAL!r} is evaluation-only: it reads the surprisal that "
                           f"evaluation.methods.varrate.surprisal sets for the prompt being coded")
    return minmax(nll.to(x.coded.device)[x.coded])


def novelty_signal(x: SignalInputs) -> torch.Tensor:
    """`eval_novelty`: 1 on the coded tokens of the most novel sentences (set for the prompt being coded), 0 else."""
    current = _novel["current"]
    if current is None or current[0] != x.seq_len:
        raise RuntimeError(f"signal {NOVELTY!r} is evaluation-only: it reads the most novel sentences that "
                           f"VarRateMethod.compress finds for the prompt being coded")
    return torch.isin(x.coded, current[1].to(x.coded.device)).float()


def register_eval_signal(name: str) -> None:
    """Register the evaluation-only signal `name` (SURPRISAL or NOVELTY) in the library's registry, once."""
    if name not in SIGNALS:
        register_signal(name)({SURPRISAL: surprisal_signal, NOVELTY: novelty_signal}[name])
