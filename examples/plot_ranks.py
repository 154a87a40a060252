"""Figure for the README: the rank VarRate gives each prompt token, made by the library itself.

    python examples/plot_ranks.py --out docs/ranks.png     (needs matplotlib: pip install matplotlib)

Compresses ~2K tokens of essays with one planted fact at budget 0.2, once with the question at the
end of the prompt (query-aware) and once without (query-agnostic), and plots layer-averaged ranks by
position. Sorted ranks would hide where the budget goes; positions show it.
"""

import argparse
import warnings

import torch

from hf_varrate import VarRateCache, VarRateLayer
from hf_varrate.demo import FACTS, chat_parts, essay_text, plant
from hf_varrate.models import load_default_model


def mean_ranks(cache, length):
    """[S] rank per prompt position averaged over the compressed layers (exact tokens: NaN)."""
    total, count = torch.zeros(length), torch.zeros(length)
    for layer in cache.layers:
        if isinstance(layer, VarRateLayer) and layer.codes and not layer.codes[0].stored_exactly:
            code = layer.codes[0]
            total[code.coded_pos] += code.ranks.float()
            count[code.coded_pos] += 1
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/ranks.png")
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    model, tokenizer = load_default_model("smollm2-135m-instruct")
    fact, question, _, lead = FACTS[0]
    text = plant(essay_text(), tokenizer, 2000, [fact], [0.5])
    doc_ids, q_ids = chat_parts(tokenizer, text, question, lead)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for label, ids in [("query-aware (question in the prompt)", doc_ids + q_ids),
                       ("query-agnostic (document alone)", doc_ids)]:
        cache = VarRateCache.from_pretrained("smollm2-135m-instruct", model=model, budget=args.budget)
        with torch.no_grad():
            model(torch.tensor([ids]), cache=cache, logits_to_keep=1)  # past_key_values= before 5.24
        cache.compress()
        ax.plot(mean_ranks(cache, len(ids)).numpy(), lw=0.6, label=label)
    needle = len(chat_parts(tokenizer, text[: text.index(fact)], "")[0])
    ax.axvline(needle, color="k", ls=":", lw=1, label="planted fact")
    ax.set(xlabel="prompt position (token)", ylabel="rank (mean over 30 layers)", yscale="log",
           title=f"SmolLM2-135M-Instruct, budget {args.budget}: rank per token (floor 16, cap 384)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
