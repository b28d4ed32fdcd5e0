"""pyproject.toml declares what dlenv needs (issue 44 item 10): `pip install -e .` (docs/distributed.md's line
for a cluster venv) brings requirements.txt, the one list of pins, and leaves PyTorch's stack to the
profile that brings its own build."""

from __future__ import annotations

import shutil
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
TORCH_STACK = {"torch", "torchvision", "torchaudio"}


def requirements_txt() -> set[str]:
    """requirements.txt's requirements, as packaging writes them (comments and blank lines dropped)."""
    lines = (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
    return {str(Requirement(line.split("#")[0])) for line in lines if line.split("#")[0].strip()}


def normalized(reqs: list[str] | None) -> set[str]:
    return {str(Requirement(r)) for r in reqs or []}


def test_requirements_txt_holds_no_pytorch_and_only_plain_requirements():
    text = (ROOT / "requirements.txt").read_text(encoding="utf-8")
    assert not [ln for ln in text.splitlines() if ln.strip().startswith("-")]  # setuptools reads no pip options
    names = {Requirement(r).name.lower() for r in requirements_txt()}
    assert len(names) >= 10 and not names & TORCH_STACK, names


def test_the_installed_dlenv_requires_exactly_requirements_txt():
    """(The metadata is written at install time: .ci/run reinstalls `-e .` at every run, as must a checkout
    whose requirements.txt changed since.)"""
    declared, wanted = normalized(metadata.requires("dlenv")), requirements_txt()
    assert declared == wanted, (f"dlenv's installed metadata lacks {sorted(wanted - declared)} and has "
                                f"{sorted(declared - wanted)} beyond requirements.txt: reinstall it (pip install "
                                "--no-deps -e .), as .ci/run does")


def test_a_fresh_build_reads_requirements_txt(tmp_path):
    """The metadata setuptools builds from this checkout now (what `pip install -e .` records)."""
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < Version("77"):  # pyproject's build-system asks for 77 (PEP 639)
        pytest.skip(f"setuptools {setuptools.__version__} here; pip builds with >= 77 in isolation")
    from setuptools import build_meta

    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        info = build_meta.prepare_metadata_for_build_editable(str(out))
    dist = metadata.Distribution.at(out / info)
    assert normalized(dist.requires) == requirements_txt()
