"""What an installed package needs: shipped bases found by name from any directory, a command line
that names itself, packaging metadata to current standards, and gguf as an optional extra."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hf_varrate import Bases, VarRateCache
from hf_varrate import models as default_models
from hf_varrate.bases_checks import CONFIG_NAME, WEIGHTS_NAME
from hf_varrate.cli import main
from hf_varrate.models import DEFAULT_MODELS
from hf_varrate.shipped import SHIPPED, shipped_path
from hf_varrate.version import __version__

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_name_loads_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (shipped_path(name) / WEIGHTS_NAME).is_file() and (shipped_path(name) / CONFIG_NAME).is_file()
    bases = Bases.from_pretrained(name)
    assert bases.metadata["model_id"] == SHIPPED[name]
    assert VarRateCache.from_pretrained(name).bases_source == name  # no model needed for the default preset


def test_every_default_model_has_shipped_bases():
    assert set(SHIPPED) == set(DEFAULT_MODELS)
    assert {name: default_models.model_id_for(name) for name in DEFAULT_MODELS} == SHIPPED


def test_a_name_that_is_not_shipped_is_left_to_folders_and_the_hub(tmp_path):
    assert shipped_path("my-bases") is None and shipped_path(tmp_path) is None
    assert shipped_path("smollm2-135m-instruct/") is None  # a path spelling is a folder, not the name


@pytest.mark.parametrize("command", ["calibrate", "demo", "push"])
def test_each_command_names_itself_in_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hf-varrate {command} ")


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"hf-varrate {__version__}"


def test_without_gguf_a_conversion_names_the_extra(monkeypatch, tmp_path):
    real = default_models.importlib.util.find_spec
    monkeypatch.setattr(default_models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r'pip install "hf_varrate\[models\]"'):
        default_models._load_gguf(DEFAULT_MODELS["smollm2-135m-instruct"], tmp_path)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is in the standard library from 3.11")
def test_pyproject_follows_current_packaging_metadata():
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]  # PEP 639: the expression only
    assert "Programming Language :: Python :: 3.10" in project["classifiers"] and project["urls"]
    assert project["dynamic"] == ["version"] and "version" not in project
    assert not [d for d in project["dependencies"] if d.startswith("gguf")]
    assert project["optional-dependencies"]["models"] == ["gguf"]
    data = pyproject["tool"]["setuptools"]["package-data"]["hf_varrate"]
    assert "shipped_bases/*/*" in data and "hub_assets/*.md" in data
