"""README.md: what a newcomer reads first holds only what they have and can run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from imagedata import make_train_val

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("doc", ["README.md", "workspace/README.md"])
def test_readme_links_only_to_files_users_have(doc):
    text = (ROOT / doc).read_text()
    links = re.findall(r"\]\(([^)#]+)", text)
    assert not [t for t in links if "shared/" in t], "users do not get the shared/ folder"
    missing = [t for t in links if not t.startswith("http") and not (ROOT / doc).parent.joinpath(t).exists()]
    assert not missing, f"{doc} links to files that do not exist: {missing}"


def _block(marker: str) -> str:
    """The one-line command in the code block right after `<!-- readme-test: marker -->`."""
    m = re.search(rf"<!-- readme-test: {marker} -->\s*```\n(.+?)\n```", README, re.S)
    assert m, f"README.md lost its '{marker}' command (or its marker comment)"
    assert "\n" not in m.group(1).strip(), "one command: one line to paste"
    return m.group(1).strip()


def _steps(marker: str) -> list[str]:
    return [s.strip() for s in _block(marker).split("&&")]


def test_readme_cpu_install_has_the_right_form():
    """The install part needs the network and minutes, so it is checked for form: a venv, the image's
    torch pins from the CPU-only index (no CUDA download), then this project with its test tools."""
    from dlenv.envcheck.pins import read_pins

    steps = _steps("cpu-main-job")
    assert steps[:2] == ["python3.10 -m venv .venv", ". .venv/bin/activate"]
    torch_line, project_line = steps[2], steps[3]
    pins = read_pins(ROOT / "environment.yml")
    for name in ("torch", "torchvision", "torchaudio"):
        version = pins[name].removeprefix("==").removesuffix(".*")
        assert f" {name}=={version}" in torch_line, f"the README installs another {name} than the image"
    assert torch_line.endswith("--index-url https://download.pytorch.org/whl/cpu")
    assert project_line == "python -m pip install -r requirements-dev.txt -e ."
    assert _steps("cpu-tests") == [". .venv/bin/activate", "dlenv test"]


def _run(cmd: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    # `dlenv` as this interpreter's module: the CI venv's console script may point at another checkout
    argv = [sys.executable, "-m", "dlenv", *shlex.split(cmd)[1:]]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MPLBACKEND": "Agg"})


def test_readme_cpu_main_job_runs(tmp_path):
    """The run part of the main-job line, executed in CI's venv: verify-env exactly as written, then
    train with the README's flags plus a 16-image folder at 32 px (--data, --img-size, --batch-size),
    so the same code path ends in seconds rather than the demo's minutes on a CPU (the demo data
    itself is tested in test_demo). Both must exit 0: the line must not stop at verify-env."""
    steps = _steps("cpu-main-job")
    verify, train = steps[-2], steps[-1]
    assert verify == "dlenv verify-env --allow-cpu" and train.startswith("dlenv train ")
    r = _run(verify, tmp_path, 120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    make_train_val(tmp_path / "ds", per_class=8, size=(32, 32))
    r = _run(f"{train} --data ds --img-size 32 --batch-size 8 --workers 0 --model resnet18", tmp_path, 240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "runs" / "exp" / "best_model.pth").is_file()


def test_readme_cpu_tests_command_runs_pytest(tmp_path):
    """`dlenv test` as written, narrowed with -k to a few fast tests (the whole suite is what CI runs
    anyway, and running it from inside itself would recurse): it must find the tests and pass."""
    assert _steps("cpu-tests")[-1] == "dlenv test"
    r = _run("dlenv test -k test_clock_text", tmp_path, 300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"\b4 passed\b", r.stdout)


@pytest.mark.parametrize("doc,needles", [
    ("docs/validation.md", ["Where `./dataset/val` comes from", "invoke unpack", "train/<class>/", "val/<class>/"]),
    ("workspace/README.md", ["./dataset/val", "invoke unpack dataset.zip", "--data data/<name>/val"]),
])
def test_docs_say_how_to_make_the_val_folder_of_the_seed_command(doc, needles):
    text = (ROOT / doc).read_text()
    assert [n for n in needles if n not in text] == []
