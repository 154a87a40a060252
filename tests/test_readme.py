"""The README is for users: short, no tracker references, and its one snippet runs as written.

The snippet test runs the ```python block verbatim in a fresh interpreter from an empty directory,
offline (HF_HUB_OFFLINE=1), on the real SmolLM2 (slow).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
USER_DOCS = [README, *sorted((REPO / "docs").rglob("*.md"))]


def readme_snippet(text: str) -> str:
    """The README's one ```python block."""
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    assert len(blocks) == 1, f"the README must have exactly one python block, found {len(blocks)}"
    return blocks[0]


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < 200, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_cite_no_issue_numbers(path):
    hits = [line for line in path.read_text().splitlines() if re.search(r"issue #?\d|issues? #", line, re.I)]
    assert not hits, f"{path.name} points into a tracker readers cannot see: {hits[:3]}"


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_readme_snippet_uses_the_shipped_bases_by_name():
    snippet = readme_snippet(README.read_text())
    assert 'VarRateCache.from_pretrained("smollm2-135m-instruct"' in snippet
    assert "hub_assets" not in snippet


@pytest.mark.slow
@pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                    reason="the README passes cache= to generate(), which transformers reads from 5.24")
def test_readme_snippet_runs_verbatim_from_any_directory(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet(README.read_text()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Footprint" in run.stdout or "%" in run.stdout, run.stdout[-2000:]


def test_examples_quickstart_is_the_readme_snippet():
    quickstart = (REPO / "examples" / "quickstart.py").read_text()
    assert quickstart.endswith(readme_snippet(README.read_text())), "examples/quickstart.py drifted from the README"
