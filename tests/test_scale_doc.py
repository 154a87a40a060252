"""docs/scale.md quotes benchmarks/scale_numbers.py: every table row the script prints must be in the doc,
so a change to the codec's budget accounting that moves a number fails here until the doc is rerun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_scale_doc_tables_are_the_script_output():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_numbers.py")], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("|")]
    assert len(rows) > 25
    doc = (REPO / "docs" / "scale.md").read_text()
    missing = [row for row in rows if row not in doc]
    assert not missing, f"docs/scale.md is stale; rerun python benchmarks/scale_numbers.py: {missing[:3]}"
    assert "python benchmarks/scale_numbers.py" in doc
