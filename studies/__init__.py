"""One-off studies behind findings in docs/evaluation.md: diagnostics that run on the evaluation harness but are not
part of it. Each runs as `python -m studies.<name>` from the repository root in `.venv-eval`; see README.md."""
