"""The footprint of a three-turn chat over two documents, turn by turn: the shipped SmolLM2 bases and the card's
one-liner (no model=), the whole sequence's `footprint().fraction` after each turn, with later turns coded
(the default, `min_turn_tokens=256`) and kept exact (`min_turn_tokens=None`, how the library behaved before).

    python -m studies.chat_turns [--tokens 1800]
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate import VarRateCache
from hf_varrate.binding import cache_kwarg
from hf_varrate.demo import FACTS, essay_text, plant
from hf_varrate.models import load_default_model


def chat(model, tokenizer, tokens: int = 1800, **overrides) -> tuple[list[tuple[int, float, str]], VarRateCache]:
    """(sequence length, fraction, answer) after each of the three turns, and the cache at the end."""
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    docs = [plant(essay_text(), tokenizer, tokens, [f[0] for f in FACTS[i : i + 2]], (0.3, 0.7), seed=i)
            for i in (0, 2)]
    users = [f"Read the text below and answer the question.\n\n{docs[0]}\n\n{FACTS[0][1]}",
             f"Here is another text.\n\n{docs[1]}\n\n{FACTS[2][1]}", FACTS[1][1]]
    cache = VarRateCache.from_pretrained("smollm2-135m-instruct", **overrides)
    ids, rows = [], []
    for turn, user in enumerate(users):
        if turn == 0:
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
        else:  # SmolLM2's ChatML, after the previous answer
            text = f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        ids = ids + encode(text)
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=12, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, **{cache_kwarg(model): cache})
        answer = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip()
        ids = out[0].tolist()
        rows.append((len(ids), cache.footprint().fraction, answer))
    return rows, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1800, help="tokens per document")
    args = parser.parse_args()
    model, tokenizer = load_default_model("smollm2-135m-instruct")
    for name, overrides in (("later turns coded", {}), ("later turns exact", {"min_turn_tokens": None})):
        for turn, (length, fraction, answer) in enumerate(chat(model, tokenizer, args.tokens, **overrides)[0], 1):
            print(f"{name}, turn {turn}: {length} tokens, fraction {fraction:.3f}, answer {answer!r}")


if __name__ == "__main__":
    main()
