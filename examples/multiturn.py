"""Compress a long document once, then answer several questions from copies of the compressed cache.

    python examples/multiturn.py                 # the default: ~3K tokens of essays with planted facts
    python examples/multiturn.py --document my.txt --question "Who wrote it?"

The whole job lives in `hf_varrate.demo` (so `hf-varrate demo` runs the same code); read it for
the pattern: chat prefix ids of the document, `model(doc_ids, cache=cache, logits_to_keep=1)` (a prefill whose
logits are not read need not hold [tokens x vocabulary] of them) and `cache.compress()` once,
then `generate(doc_ids + question_ids, cache=copy.deepcopy(cache))` per question (`past_key_values=` on
transformers < 5.24).
"""

from hf_varrate.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
