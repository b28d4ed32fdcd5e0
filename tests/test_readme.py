"""README.md: what a newcomer reads first holds only what they have and can run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
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
    """Command 1 is the setup script, the venv, verify-env, then the demo as a newcomer runs it (no flags:
    the CPU recipe is the trainer's own choice). The script installs the image's torch pins on Python 3.10
    and CI's newest lane's on a newer Python; the install itself runs in the slow test below."""
    from dlenv.envcheck.pins import read_pins

    assert _steps("cpu-main-job") == ["bash scripts/tools/setup-cpu.sh", ". .venv/bin/activate",
                                      "dlenv verify-env --allow-cpu", "dlenv train"]
    script = (ROOT / "scripts" / "tools" / "setup-cpu.sh").read_text()
    pins = read_pins(ROOT / "environment.yml")
    image = " ".join(f"{n}=={pins[n].removeprefix('==').removesuffix('.*')}" for n in ("torch", "torchvision",
                                                                                          "torchaudio"))
    assert f'IMAGE_PINS="{image}"' in script, "the setup script installs another torch than the image"
    newest = re.search(r"make_venv newest \"[^\"]+\" (.+)", (ROOT / ".ci" / "run").read_text()).group(1).strip()
    assert f'NEWEST_PINS="{newest}"' in script, "the setup script installs another torch than CI's newest lane"
    assert "--index-url \"$CPU_INDEX\"" in script and "cannot be reached" in script
    assert _steps("cpu-tests") == [". .venv/bin/activate", "dlenv test"]


def _run(cmd: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    # `dlenv` as this interpreter's module: the CI venv's console script may point at another checkout
    argv = [sys.executable, "-m", "dlenv", *shlex.split(cmd)[1:]]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MPLBACKEND": "Agg"})


def test_readme_cpu_main_job_runs(tmp_path):
    """The run part of the main-job line, executed in CI's venv: verify-env exactly as written, then
    train with the README's flags plus a 16-image folder at 32 px for one epoch (--data, --img-size,
    --batch-size, --epochs), so the same code path ends in seconds rather than the demo's minutes on a
    CPU (the demo data itself is tested in test_demo). Both must exit 0: the line must not stop at verify-env."""
    steps = _steps("cpu-main-job")
    verify, train = steps[-2], steps[-1]
    assert verify == "dlenv verify-env --allow-cpu" and train.startswith("dlenv train")
    r = _run(verify, tmp_path, 120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    make_train_val(tmp_path / "ds", per_class=8, size=(32, 32))
    r = _run(f"{train} --data ds --img-size 32 --batch-size 8 --workers 0 --model resnet18 --epochs 1", tmp_path, 240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "runs" / "exp" / "best_model.pth").is_file()


@pytest.mark.slow  # 8-10 s collecting the suite again; whoever runs `dlenv test` is running this test already
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


def _copy_checkout(dest: Path) -> Path:
    """The files a clone of this checkout would hold (tracked and new ones, not ignored), in `dest`."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())
    return dest


def _timed(cmd: str, cwd: Path, env: dict, log: Path) -> subprocess.CompletedProcess:
    """`cmd` through bash as a user pastes it; its output and wall time kept in `log` (and printed, for -s),
    as these are the numbers the README quotes."""
    start = time.monotonic()
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    took = f"== {cmd}\n== exit {r.returncode} after {time.monotonic() - start:.0f} s wall\n"
    log.write_text(took + r.stdout + "\n== stderr\n" + r.stderr)
    print(took + r.stdout[-4000:])
    return r


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DLENV_README_E2E") != "1",
                    reason="a fresh venv and the PyTorch download (4.1 GB from PyPI) plus the demo and the quick "
                           "tests: 8:25 on 2 cores (2026-12-02); run with DLENV_README_E2E=1")
def test_readme_cpu_commands_exactly_as_printed(tmp_path):
    """Both CPU commands, character for character, in a fresh copy of the checkout: the set-up (network:
    PyPI, pip's own cache reused), verify-env, the demo's CPU recipe to >= 90% top-1, then `dlenv test`.
    HOME is a temporary folder, so the ~/.invoke.yaml the set-up writes is not the machine's."""
    repo = _copy_checkout(tmp_path / "repo")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HOME=str(home), MPLBACKEND="Agg", PATH=os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if "dlenv-ci" not in p and ".venv" not in p))
    env.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    if (Path.home() / ".pyenv").is_dir():
        env.setdefault("PYENV_ROOT", str(Path.home() / ".pyenv"))
    first = _timed(_block("cpu-main-job"), repo, env, tmp_path / "command1.log")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "setup-cpu: done in" in first.stdout and "no GPU: the demo's CPU recipe" in first.stdout
    rows = (repo / "runs" / "exp" / "results.csv").read_text().splitlines()
    top1 = float(rows[-1].split(",")[rows[0].split(",").index("top1")])
    assert top1 >= 90.0, f"the demo's CPU recipe ended at top-1 {top1}"
    assert "setup-cpu: `dlenv VERB`" in first.stdout and not (home / ".invoke.yaml").exists()
    second = _timed(_block("cpu-tests"), repo, env, tmp_path / "command2.log")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert re.search(r"tests \d+/\d+ .*ETA", second.stdout)
    # nothing after the summary: no 'unclosed socket' (or other) ResourceWarning from a test's leftovers
    assert "ResourceWarning" not in second.stdout + second.stderr, second.stderr[-3000:]


def test_setup_without_a_python_310_says_how_to_get_one(tmp_path):
    """No Python 3.10 or newer anywhere (only an old python3): one line on how to get 3.10, exit 2."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "date"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    old = bin_dir / "python3"
    old.write_text("#!/bin/sh\nexit 1\n")  # what `python3 -c 'assert sys.version_info >= (3, 10)'` does on 3.8
    old.chmod(0o755)
    r = subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "tools" / "setup-cpu.sh")], capture_output=True,
                       text=True, env={"PATH": str(bin_dir), "HOME": str(tmp_path)}, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "no Python 3.10 or newer found" in r.stderr and "pyenv install 3.10" in r.stderr
    assert r.stdout == ""  # nothing was set up
