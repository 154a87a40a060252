"""Quality evaluation of hf_varrate against real peers (kvpress presses, transformers' QuantizedCache).

Run `python -m evaluation.run --config evaluation/configs/<name>.yaml`. Needs the `eval` extra
(kvpress pins transformers < 5.3, so this runs in `.venv-eval`: `make eval-venv`). See README.md.
"""
