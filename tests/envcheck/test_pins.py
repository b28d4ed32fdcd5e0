"""The pins agree everywhere: environment.yml, environment.modern.yml, requirements*.txt and CI's
"image pins" lane, and (in that lane or the image) the installed versions satisfy them.

Parsed here independently of dlenv.envcheck (PyYAML and packaging only), so a bug in envcheck's pin
reader cannot hide a disagreement between the files.
"""

from __future__ import annotations

import os
import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEFAULT, MODERN = ROOT / "environment.yml", ROOT / "environment.modern.yml"
LANE = os.environ.get("DLENV_CI_LANE")
IN_IMAGE = os.environ.get("DLENV_IMAGE") == "1"
CONDA_TO_PIP = {"pytorch": "torch"}


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path.name} is not shipped here")
    return path


def env(path: Path) -> dict:
    return yaml.safe_load(need(path).read_text(encoding="utf-8"))


def conda_specs(data: dict) -> dict[str, str]:
    """{pip name: conda version spec} of the conda part ('pytorch::pytorch=1.13.1' -> torch: '=1.13.1')."""
    out = {}
    for dep in data["dependencies"]:
        if isinstance(dep, str):
            m = re.match(r"(?:[\w-]+::)?([A-Za-z0-9_.-]+)\s*(.*)", dep)
            name = canonicalize_name(m.group(1))
            out[CONDA_TO_PIP.get(name, name)] = m.group(2).replace(" ", "")
    return out


def pip_lines(data: dict) -> list[str]:
    return [str(x) for dep in data["dependencies"] if isinstance(dep, dict) for x in dep.get("pip", [])]


def requirements(path: Path) -> dict[str, Requirement]:
    """{name: Requirement} of a requirements file, following -r includes."""
    out: dict[str, Requirement] = {}
    for raw in need(path).read_text(encoding="utf-8").splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r "):
            out.update(requirements(path.parent / line.split(None, 1)[1]))
        elif line and not line.startswith("-"):
            req = Requirement(line)
            out[canonicalize_name(req.name)] = req
    return out


def pip_requirements(data: dict, machine: str = "x86_64") -> dict[str, Requirement]:
    """{name: Requirement} of the pip section, for lines whose environment marker holds on `machine`."""
    reqs = {}
    for line in pip_lines(data):
        if not line.startswith("-"):
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"platform_machine": machine}):
                assert canonicalize_name(req.name) not in reqs, f"{req.name} is pinned twice for {machine}"
                reqs[canonicalize_name(req.name)] = req
    return reqs


def conda_exact(spec: str) -> str:
    """'=1.13.1' or '=1.0=cuda' -> '1.13.1' / '1.0'; fails for anything but an exact conda pin."""
    assert re.fullmatch(r"=[0-9][0-9.]*(=\S+)?", spec), f"not an exact conda pin: {spec!r}"
    return spec[1:].split("=")[0]


def ci_image_pins() -> dict[str, str]:
    """What .ci/run installs in the "image pins" lane: python and pkg==version of `make_venv image-pins`."""
    text = need(ROOT / ".ci" / "run").read_text(encoding="utf-8")
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("make_venv image-pins")), None)
    assert line, ".ci/run has no `make_venv image-pins ...` line"
    pins = {"python": re.search(r"find_python ([0-9.]+)", line).group(1)}
    for token in shlex.split(line):
        if "==" in token:
            name, version = token.split("==")
            pins[canonicalize_name(name)] = version
    return pins


# ---------------------------------------------------------------------------------------------------
# The files agree with each other


def test_default_profile_pins_equal_the_ci_image_pins_lane():
    conda = conda_specs(env(DEFAULT))
    ci = ci_image_pins()
    for name in ("python", "torch", "torchvision", "torchaudio"):
        assert conda_exact(conda[name]) == ci[name], (
            f"environment.yml pins {name}{conda[name]} but .ci/run's image-pins lane installs {ci[name]}")


def test_default_profile_is_the_cuda_build_from_the_pytorch_channel():
    data = env(DEFAULT)
    assert "defaults" not in data["channels"] and "nodefaults" in data["channels"]
    assert data["channels"][:2] == ["pytorch", "nvidia"]
    deps = [d for d in data["dependencies"] if isinstance(d, str)]
    for pkg in ("pytorch", "torchvision", "torchaudio", "pytorch-cuda"):
        assert any(d.startswith(f"pytorch::{pkg}=") for d in deps), f"{pkg} is not taken from the pytorch channel"
    conda = conda_specs(data)
    assert conda_exact(conda["pytorch-cuda"]) == "11.6"
    assert conda["pytorch-mutex"].endswith("=cuda")
    assert not SpecifierSet(conda["mkl"]).contains("2024.1")
    assert "cpuonly" not in conda


def test_numpy_bounds_agree_between_conda_and_requirements():
    req = requirements(ROOT / "requirements.txt")["numpy"].specifier
    for path in (DEFAULT, MODERN):
        conda = SpecifierSet(conda_specs(env(path))["numpy"])
        assert conda == req, f"{path.name} pins numpy {conda}, requirements.txt {req}"
        assert not conda.contains("2.0.0")  # torch 1.13 is built against NumPy 1.x


def test_packages_named_in_both_places_have_the_same_bounds():
    reqs = {**requirements(ROOT / "requirements.txt"), **requirements(ROOT / "requirements-dev.txt")}
    for path in (DEFAULT, MODERN):
        data = env(path)
        for name, spec in conda_specs(data).items():
            if name in reqs and not spec.startswith("="):
                assert SpecifierSet(spec) == reqs[name].specifier, f"{path.name}: {name} {spec} vs {reqs[name]}"
        for name, req in pip_requirements(data).items():
            if name in reqs:
                assert req.specifier == reqs[name].specifier, f"{path.name}: {req} vs {reqs[name]}"


@pytest.mark.parametrize("path", [DEFAULT, MODERN], ids=lambda p: p.name)
def test_both_env_files_include_requirements_txt(path):
    data = env(path)
    assert data["name"] == "dl"
    assert "-r requirements.txt" in pip_lines(data)
    assert "torch" not in requirements(ROOT / "requirements.txt"), "torch belongs to the env files"


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_modern_profile_is_a_cuda_12_8_plus_torch_2_with_matching_companions(machine):
    data = env(MODERN)
    assert "nodefaults" in data["channels"] and "defaults" not in data["channels"]
    reqs = pip_requirements(data, machine)
    versions = {}
    for name in ("torch", "torchvision", "torchaudio"):
        (spec,) = reqs[name].specifier
        assert spec.operator == "==", f"{name} must be pinned exactly"
        versions[name] = Version(spec.version)
    torch_v = versions["torch"]
    assert torch_v.major == 2
    cuda = {v.local for v in versions.values()}
    if machine == "aarch64":  # companions without the tag there (see the env file); torch keeps it
        cuda = {versions["torch"].local}
    assert len(cuda) == 1, f"torch, torchvision and torchaudio are built for different CUDAs: {cuda}"
    (local,) = cuda
    assert re.fullmatch(r"cu\d+", local) and int(local[2:]) >= 128, "sm_100/sm_120 kernels need CUDA 12.8+"
    # torchvision 0.(minor+15) and torchaudio == torch are the releases built together for 2.x
    assert versions["torchvision"].release[:2] == (0, torch_v.minor + 15)
    assert versions["torchaudio"].release[:2] == torch_v.release[:2]
    index = [ln for ln in pip_lines(data) if ln.startswith("--extra-index-url")]
    assert index and index[0].rstrip("/").endswith(f"/whl/{local}"), "the pip index is for another CUDA"
    py = conda_exact(conda_specs(data)["python"])
    assert Version(py) >= Version("3.10")


# ---------------------------------------------------------------------------------------------------
# What is installed agrees with the files (CI lanes and the image)


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(LANE != "image-pins", reason="only CI's image-pins lane installs environment.yml's torch")
def test_image_pins_lane_runs_environment_yml_torch():
    import platform

    conda = conda_specs(env(DEFAULT))
    for name in ("torch", "torchvision", "torchaudio"):
        version = installed(name)
        assert version is not None, f"{name} is not installed in the image-pins lane"
        assert Version(version).public == conda_exact(conda[name]), f"{name} {version} != {conda[name]}"
    assert platform.python_version().startswith(conda_exact(conda["python"]) + ".")


@pytest.mark.skipif(not (LANE or IN_IMAGE), reason="checks a CI lane's or the image's installed packages")
def test_installed_packages_satisfy_requirements_txt():
    for name, req in requirements(ROOT / "requirements.txt").items():
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = installed(name)
        assert version is not None, f"{name} from requirements.txt is not installed"
        assert req.specifier.contains(version, prereleases=True), f"{name} {version} does not satisfy {req}"


# ---------------------------------------------------------------------------------------------------
# setuptools, the tensorboard command and the image's lock (scripts/tools/lock_env.py)


def test_setuptools_stays_below_82_everywhere_it_is_named():
    # setuptools 82 removed pkg_resources, which the `tensorboard` command imports
    spec = requirements(ROOT / "requirements.txt")["setuptools"].specifier
    assert not spec.contains("82.0.0") and spec.contains("81.0.0")
    for path in (DEFAULT, MODERN):
        assert SpecifierSet(conda_specs(env(path))["setuptools"]) == spec, path.name


@pytest.mark.skipif(not (LANE or IN_IMAGE), reason="checks a CI lane's or the image's installed commands")
def test_the_tensorboard_command_runs():
    import subprocess
    import sys

    tool = Path(sys.executable).parent / "tensorboard"
    assert tool.is_file(), f"{tool} is missing: tensorboard is in requirements.txt"
    r = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == installed("tensorboard")


def lock_env():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock_env", ROOT / "scripts" / "tools" / "lock_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path, want", [
    (DEFAULT, ["python 3.10.*", "pytorch::pytorch 1.13.1.*", "pytorch::torchvision 0.14.1.*",
               "pytorch::torchaudio 0.13.1.*", "pytorch::pytorch-cuda 11.6.*", "pytorch::pytorch-mutex 1.0.* cuda",
               "numpy >=1.23,<2", "mkl <2024.1", "setuptools >=65,<82"]),
    (MODERN, ["python 3.11.*", "numpy >=1.23,<2", "setuptools >=65,<82", "gxx >=12,<15"]),
], ids=lambda v: v.name if isinstance(v, Path) else "")
def test_conda_pinned_holds_every_conda_pin_of_the_profile(path, want):
    assert lock_env().pinned_lines(env(path)) == want


def test_pinned_line_syntax():
    lines = lock_env().pinned_lines({"dependencies": ["python=3.10", "a::b=1.0=cuda", "c >=1, <2", "pip", {"pip": []}]})
    assert lines == ["python 3.10.*", "a::b 1.0.* cuda", "c >=1,<2"]


def test_the_pip_lock_lists_what_pip_installed_exactly():
    lines = lock_env().pip_lines()
    pins = [Requirement(ln) for ln in lines if not ln.startswith("--")]
    assert pins and all(str(r.specifier).startswith("==") for r in pins)
    names = {canonicalize_name(r.name) for r in pins}
    assert "dlenv" not in names and "pytest" in names
    for r in pins:
        assert r.specifier.contains(installed(r.name), prereleases=True)
    indexes = [ln for ln in lines if ln.startswith("--extra-index-url")]
    assert all(re.fullmatch(r"--extra-index-url https://download\.pytorch\.org/whl/cu\d+", ln) for ln in indexes)


def test_the_pip_constraints_hold_the_installed_torch_stack():
    lines = lock_env().constraint_lines()

    def exactly(name):  # the whole version string: `===` unless a local label makes `==` exact
        v = installed(name)
        return f"{name}=={v}" if "+" in v else f"{name}==={v}"

    assert exactly("torch") in lines and exactly("torchvision") in lines
    assert all(ln.split("==")[0] in ("torch", "torchvision", "torchaudio") for ln in lines)


def test_verify_env_reads_the_pins_of_this_machine():
    import platform

    from dlenv import envcheck

    pins = envcheck.read_pins(MODERN)
    want = pip_requirements(env(MODERN), platform.machine())["torchvision"].specifier
    assert pins["torchvision"] == str(want) and pins["torch"] == "==2.11.0+cu128" and pins["cuda"] == "==12.8.*"
    assert envcheck.pins._marker_applies(f'platform_machine == "{platform.machine()}"')
    assert not envcheck.pins._marker_applies('platform_machine == "no-such-machine"')
