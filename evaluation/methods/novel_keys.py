"""Evaluation only: exact keys for the sentences that stand out from their neighbours (a hypothesis).

`studies.needle_attention` found that the needle sentences' own keys carry the preset's loss on SmolLM2, and that
no query-agnostic choice tried so far finds them: the keys the codes err on most hold 5% of the needles' key words,
the document's heavy hitters 0.1-0.7% of their tokens. A fact planted in an essay, or any sentence that says
something its surroundings do not, differs from the sentences around it in what the model writes into its values.
So each sentence of the prompt (split at ., ! or ? followed by a space, and at line breaks, on the decoded text)
gets a novelty: one minus the cosine between the mean of its tokens' values (heads side by side) and the mean of
the values of the `window` sentences on each side of it, averaged over the full-attention layers. The most novel
sentences, whole, until they hold round(p * S) tokens, get their exact keys in every full-attention layer (the
first sentence, which holds the attention sink, is left out: it is stored exactly anyway).

Query-agnostic: it reads the compressed prompt's own token ids and values, nothing of the question. Its settings
(`window` 4, the mean over layers, whole sentences) were chosen on development examples 100-109 of SmolLM2's
multi-key needles at 4K, by the share of needle tokens chosen (2%: 0.65 of them, 5%: 0.83; each layer choosing
its own: 0.40 / 0.73), before any answer was read. A VarRate method spec with `eval_novel_keys: p` (and
`eval_novel_window: k`) spends the spec's budget as `eval_read_keys` does (see `read_keys`): the exact keys and
their positions charged, the codec at the rest. `signal: eval_novelty` (with `eval_novel_share: p`) spends rank on
them instead: see `evaluation.methods.varrate`.
"""

from __future__ import annotations

import bisect
import re

import torch

WINDOW = 4  # sentences on each side of a sentence that its novelty is measured against
SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n+")


def token_offsets(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """(the prompt's text, each position's (start, stop) character span in it): the ids decoded and re-encoded with
    offsets; a leading BOS gets (0, 0). A tokenizer that does not give back the same ids is refused rather than
    mapped approximately."""
    lead = 1 if ids and ids[0] == tokenizer.bos_token_id else 0
    text = tokenizer.decode(ids[lead:])
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if encoded["input_ids"] != ids[lead:]:
        raise ValueError("the prompt does not re-encode to its own token ids, so its words cannot be located by "
                         "character offsets; this needs a tokenizer whose decode round-trips")
    return text, [(0, 0)] * lead + [tuple(span) for span in encoded["offset_mapping"]]


def sentence_of(tokenizer, ids: list[int]) -> torch.Tensor:
    """[S] LongTensor: the sentence (0, 1, ...) each position is in. A token belongs to the sentence its last
    character is in, so the space a token starts with stays with the sentence the token begins."""
    text, offsets = token_offsets(tokenizer, ids)
    ends = [match.end() for match in SENTENCE_END.finditer(text)]
    return torch.tensor([bisect.bisect_right(ends, max(start, stop - 1)) for start, stop in offsets],
                        dtype=torch.long)


def heads_side_by_side(states: torch.Tensor) -> torch.Tensor:
    """[S, H * d] float: one layer's keys or values ([1, H, S, d]), each position's heads side by side."""
    return states[0].float().permute(1, 0, 2).reshape(states.shape[-2], -1)


def sentence_novelty(values: dict[int, torch.Tensor], sentences: torch.Tensor,
                     window: int = WINDOW) -> torch.Tensor:
    """[n] per sentence: 1 - cos(the mean of its tokens' values, the token-weighted mean of the `window` sentences'
    on each side), per layer of `values` ({layer: [1, H, S, d]}), averaged over the layers. A sentence with no
    token (two breaks in a row) gets -inf."""
    count = torch.bincount(sentences).float()
    n = count.numel()
    # [n, n] weights: sentence j's tokens count toward sentence i's surroundings when 0 < |i - j| <= window
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs()
    around = ((distance > 0) & (distance <= window)).float() * count[None]
    around = around / around.sum(dim=1, keepdim=True).clamp_min(1)
    novelty = torch.zeros(n)
    for layer_values in values.values():
        flat = heads_side_by_side(layer_values)
        means = torch.zeros(n, flat.shape[1]).index_add_(0, sentences, flat) / count[:, None].clamp_min(1)
        novelty += 1 - torch.nn.functional.cosine_similarity(means, around @ means, dim=1)
    novelty /= len(values)
    return novelty.masked_fill(count == 0, float("-inf"))


def novel_tokens(novelty: torch.Tensor, sentences: torch.Tensor, share: float) -> torch.Tensor:
    """The positions of the most novel sentences, whole, until they hold round(share * S) tokens (the last one may
    take it past); the first position's sentence left out. Sorted."""
    goal = max(1, round(share * sentences.numel()))
    novelty = novelty.clone()
    novelty[sentences[0]] = float("-inf")
    count = torch.bincount(sentences, minlength=novelty.numel())
    chosen, held = [], 0
    for sentence in novelty.argsort(descending=True).tolist():
        if held >= goal or novelty[sentence] == float("-inf"):
            break
        chosen.append(sentence)
        held += int(count[sentence])
    return torch.isin(sentences, torch.tensor(chosen, dtype=torch.long)).nonzero().flatten()


def most_novel(tokenizer, ids: list[int], captured, layers: list[int], share: float,
               window: int = WINDOW) -> torch.Tensor:
    """The positions of the prompt's most novel sentences (`novel_tokens`), their novelty read on `layers`' values."""
    return most_novel_shares(tokenizer, ids, captured, layers, [share], window)[share]


def most_novel_shares(tokenizer, ids: list[int], captured, layers: list[int], shares: list[float],
                      window: int = WINDOW) -> dict[float, torch.Tensor]:
    """{share: `most_novel` at that share}, the novelty computed once for them all."""
    sentences = sentence_of(tokenizer, ids)
    novelty = sentence_novelty({i: captured.values[i] for i in layers}, sentences, window)
    return {share: novel_tokens(novelty, sentences, share) for share in shares}


def choose(tokenizer, ids: list[int], captured, layers: list[int], share: float,
           window: int = WINDOW) -> dict[int, torch.Tensor]:
    """{layer: positions} for every one of `layers`: the same most novel sentences' tokens (`most_novel`)."""
    rows = most_novel(tokenizer, ids, captured, layers, share, window)
    return {i: rows for i in layers}
