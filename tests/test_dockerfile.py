"""The Dockerfile and .dockerignore, checked by reading them (no Docker engine needed), and the scripts the
build runs (scripts/tools/check_build.py), run here on this lane's packages.

The Dockerfile is parsed into stages and instructions (tests/dockerfile.py), and what the image promises
is asserted on that structure: the installer per architecture, the order of layers (env before code),
what each RUN does together, the lock, what the runtime stage ends with, and that the files it copies
survive .dockerignore. Running the ENTRYPOINT and the task discovery is tests/test_entrypoint.py's and
tests/test_tasks_discovery.py's job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from dockerfile import DIRECTIVES, DOCKERFILE, INSTRUCTIONS, ROOT, STAGES, entrypoint

DIGEST = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")
DOCS = ROOT / "docs" / "docker.md"

if not DOCKERFILE.is_file():
    pytest.skip("the Dockerfile is not shipped here", allow_module_level=True)


def index(stage: list, instr: str, pattern: str) -> int:
    """Position of the first `instr` in `stage` whose arguments match `pattern`; fails if none does."""
    for i, (name, args) in enumerate(stage):
        if name == instr and re.search(pattern, args):
            return i
    raise AssertionError(f"no {instr} matching {pattern!r}")


def arg_default(stage: list, name: str) -> str:
    args = [a for i, a in stage if i == "ARG" and a.startswith(f"{name}=")]
    assert args, f"ARG {name} has no default"
    return args[0].split("=", 1)[1]


def test_no_syntax_directive_so_the_engines_own_frontend_builds_it_offline():
    # `# syntax=` pulls a frontend image (no registry, no build); the frontend built into Docker 20.10
    # rejects ADD --checksum, COPY --link and heredocs, so none of them may appear either
    assert not [d for d in DIRECTIVES if d.lower().startswith("syntax=")], DIRECTIVES
    for instr, args in INSTRUCTIONS:
        assert not (instr == "ADD" and "--checksum" in args), args
        assert not (instr == "COPY" and "--link" in args), args
        assert "<<" not in args, f"a heredoc in {instr}: Docker 20.10's frontend does not parse it"


def test_base_image_is_pinned_by_tag_and_digest_with_a_refresh_recipe():
    base = arg_default(STAGES[""], "BASE_IMAGE")
    assert DIGEST.match(base), f"BASE_IMAGE {base} is not tag@sha256:digest"
    assert "11.6" in base.split("@")[0] and "cudnn" in base
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "docker buildx imagetools inspect" in text
    # the modern profile's base, given in the header for copy and paste, is pinned the same way
    modern = re.search(r"modern base:\s*(\S+)", text)
    assert modern and DIGEST.match(modern.group(1)) and ":12." in modern.group(1)


@pytest.mark.parametrize("path", [DOCKERFILE, DOCS], ids=lambda p: p.name)
def test_plain_ubuntu_fallback_for_when_the_cuda_tag_is_gone_is_documented(path):
    text = path.read_text(encoding="utf-8")
    assert "BASE_IMAGE=ubuntu:22.04" in text
    # why it still works: conda brings the CUDA runtime, and the build check proves the CUDA build
    assert "pytorch-cuda" in text and 'torch.version.cuda == "11.6"' in text


def test_stages_installer_per_architecture_then_builder_and_runtime_on_the_same_base():
    names = [n for n in STAGES if n]
    assert names == ["miniforge-amd64", "miniforge-arm64", "miniforge", "builder", "env", "runtime"]
    assert STAGES["miniforge"][0][1] == "miniforge-${TARGETARCH}"
    assert all(STAGES[n][0][1] == "${BASE_IMAGE}" for n in ("builder", "runtime"))
    # /opt/conda comes from the builder unless ENV_IMAGE names a ready env (CI's image lane)
    assert STAGES["env"] == [("FROM", "${ENV_IMAGE}")] and arg_default(STAGES[""], "ENV_IMAGE") == "builder"
    runtime = STAGES["runtime"]
    i_copy = index(runtime, "COPY", r"--from=env\s+/opt/conda\s+/opt/conda")
    assert all(not (i == "COPY" and "--from" in a) for i, a in runtime[i_copy + 1:])


@pytest.mark.parametrize("arch, uname", [("amd64", "x86_64"), ("arm64", "aarch64")])
def test_each_architecture_gets_its_own_installer_and_checksum(arch, uname):
    stage = STAGES[f"miniforge-{arch}"]
    assert stage[0][1] == "scratch"
    add = stage[index(stage, "ADD", r"github\.com/conda-forge/miniforge")][1]
    assert f"Linux-{uname}.sh" in add and "${MINIFORGE_VERSION}" in add
    assert arg_default(STAGES[""], "MINIFORGE_VERSION")
    var = f"MINIFORGE_SHA256_{arch.upper()}"
    assert re.fullmatch(r"[0-9a-f]{64}", arg_default(STAGES[""], var))
    assert ("ARG", var) in STAGES["builder"]


def test_the_two_installers_have_different_checksums():
    sums = {arg_default(STAGES[""], f"MINIFORGE_SHA256_{a.upper()}") for a in ("amd64", "arm64")}
    assert len(sums) == 2


def test_miniforge_is_checked_mounted_not_copied_and_cleaned_in_the_same_run():
    builder = STAGES["builder"]
    run = builder[index(builder, "RUN", r"miniforge\.sh -b -p /opt/conda")][1]
    assert "--mount=type=bind,from=miniforge," in run, "the installer must not become a layer"
    assert "conda clean -afy" in run and "channel_priority strict" in run
    assert "tini=" in run  # the ENTRYPOINT's binary comes from here
    # the checksum is checked before the installer runs, with the one of the architecture being built
    assert run.index("sha256sum --check") < run.index("bash /tmp/miniforge.sh")
    assert 'arm64) sum="${MINIFORGE_SHA256_ARM64}"' in run and '*) sum="${MINIFORGE_SHA256_AMD64}"' in run
    assert ("ARG", "TARGETARCH") in builder[:index(builder, "RUN", r"miniforge\.sh -b -p")]


def test_the_checksum_check_fails_a_wrong_download(tmp_path):
    # the RUN's own check, run by bash on a file that is not the installer
    builder = STAGES["builder"]
    run = builder[index(builder, "RUN", r"miniforge\.sh -b -p /opt/conda")][1]
    check = run[run.index("case "):run.index("&& bash /tmp/miniforge.sh")].replace("/tmp/miniforge.sh",
                                                                                     str(tmp_path / "m.sh"))
    (tmp_path / "m.sh").write_text("echo not miniforge\n")
    env = {**os.environ, "TARGETARCH": "amd64",
           "MINIFORGE_SHA256_AMD64": arg_default(STAGES[""], "MINIFORGE_SHA256_AMD64"),
           "MINIFORGE_SHA256_ARM64": arg_default(STAGES[""], "MINIFORGE_SHA256_ARM64")}
    r = subprocess.run(["bash", "-o", "pipefail", "-c", check], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "does not match its sha256 2e1ad218" in r.stderr, r.stderr
    import hashlib

    env["MINIFORGE_SHA256_AMD64"] = hashlib.sha256((tmp_path / "m.sh").read_bytes()).hexdigest()
    r = subprocess.run(["bash", "-o", "pipefail", "-c", check], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_env_is_created_from_the_env_file_alone_pinned_and_cleaned_in_the_same_run():
    builder = STAGES["builder"]
    i_run = index(builder, "RUN", r"conda env create")
    run = builder[i_run][1]
    assert "conda clean -afy" in run and "--name dl" in run and "${ENV_FILE}" in run
    assert re.search(r"lock_env\.py pinned \"/tmp/env/\$\{ENV_FILE\}\"\s*> /opt/conda/envs/dl/conda-meta/pinned", run)
    assert "source=scripts/tools/lock_env.py" in run
    copies = [a for i, a in builder[:i_run] if i == "COPY"]
    assert copies == ["${ENV_FILE} requirements.txt /tmp/env/"], "only the env file may feed the env layer"
    assert arg_default(builder, "ENV_FILE") == "environment.yml"


def test_arm64_with_the_default_profile_stops_with_a_reason():
    builder = STAGES["builder"]
    run = builder[index(builder, "RUN", r"conda env create")][1]
    assert '"${TARGETARCH}" = arm64' in run and "environment.modern.yml" in run and "exit 1" in run
    assert ("ARG", "TARGETARCH") in builder


def test_build_check_runs_the_check_script_for_the_profiles_cuda():
    runtime = STAGES["runtime"]
    check = runtime[index(runtime, "RUN", r"check_build\.py")][1]
    assert '--cuda "${TORCH_CUDA}"' in check and "--mount=type=bind,source=scripts/tools," in check
    # the default expected CUDA is environment.yml's pytorch-cuda pin
    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    cuda = next(d.split("=")[1] for d in env["dependencies"] if isinstance(d, str) and "pytorch-cuda=" in d)
    assert arg_default(runtime, "TORCH_CUDA") == cuda


def test_the_lock_is_recorded_after_the_check_and_constrains_pip():
    runtime = STAGES["runtime"]
    i_run = index(runtime, "RUN", r"check_build\.py")
    run = runtime[i_run][1]
    assert run.index("check_build.py") < run.index("lock_env.py conda")
    assert "lock_env.py pip > /opt/dlenv/lock/pip.txt" in run
    assert "lock_env.py constraints > /opt/dlenv/lock/constraints.txt" in run
    # conda's half follows how the env was made (ENV_KIND): never skipped for a conda env
    assert 'lock_env.py conda "${ENV_KIND}" /opt/dlenv/lock/conda-explicit.txt' in run
    assert arg_default(runtime, "ENV_KIND") == "conda"
    i_env = index(runtime, "ENV", r"PIP_CONSTRAINT=/opt/dlenv/lock/constraints\.txt")
    assert i_env > i_run, "PIP_CONSTRAINT before the file exists would break the build's own pip"


def test_modern_build_command_matches_the_modern_env_file():
    env = yaml.safe_load((ROOT / "environment.modern.yml").read_text(encoding="utf-8"))
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    local = re.search(r"torch==[\d.]+\+cu(\d+)(\d)", " ".join(pip))
    want = f"{local.group(1)}.{local.group(2)}"
    sources = [DOCKERFILE] + [p for p in (DOCS,) if p.is_file()]
    for path in sources:
        commands = re.findall(r"ENV_FILE=environment\.modern\.yml.*?TORCH_CUDA=([\d.]+)",
                              path.read_text(encoding="utf-8").replace("\\\n", " "), re.S)
        assert commands, f"{path.name} has no modern build command"
        assert set(commands) == {want}, f"{path.name} builds the modern profile with TORCH_CUDA {commands}"


def test_runtime_env_activates_dl_and_sets_the_nvidia_variables():
    runtime = STAGES["runtime"]
    env = " ".join(a for i, a in runtime if i == "ENV")
    values = dict(re.findall(r"(\w+)=(\S+)", env))
    assert values["PATH"].startswith("/opt/conda/envs/dl/bin:")
    assert values["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(values["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}
    assert values["DLENV_IMAGE"] == "1"  # tests/conftest.py's `image` marker
    assert values["DLENV_ENV_FILE"] == "/opt/dlenv/${ENV_FILE}"
    # what the image's own tests read to know how it was built (tests/test_image_env.py)
    assert values["DLENV_ENV_KIND"] == "${ENV_KIND}" and values["DLENV_TORCH_CUDA"] == "${TORCH_CUDA}"
    bashrc = runtime[index(runtime, "RUN", r"bash\.bashrc")][1]
    assert "conda activate dl" in bashrc and "chmod 755 /root" in bashrc
    assert '[ "${ENV_KIND}" = conda ]' in bashrc


@pytest.mark.parametrize("kind", ["conda", "pip"])
def test_the_bashrc_line_for_each_env_kind(tmp_path, kind):
    runtime = STAGES["runtime"]
    run = runtime[index(runtime, "RUN", r"bash\.bashrc")][1].replace("/etc/bash.bashrc", str(tmp_path / "rc"))
    run = run[:run.index("&& chmod 755 /root")]
    r = subprocess.run(["bash", "-c", run], capture_output=True, text=True, env={**os.environ, "ENV_KIND": kind})
    assert r.returncode == 0, r.stderr
    last = (tmp_path / "rc").read_text().splitlines()[-1]
    want = {"conda": ". /opt/conda/etc/profile.d/conda.sh && conda activate dl",
            "pip": "export PATH=/opt/conda/envs/dl/bin:$PATH"}[kind]
    assert last == want


def test_code_is_copied_after_the_env_and_the_tasks_come_from_a_system_invoke_config():
    runtime = STAGES["runtime"]
    i_env = index(runtime, "COPY", r"--from=env")
    i_check = index(runtime, "RUN", r"check_build\.py")
    i_conf = index(runtime, "COPY", r"docker/etc/invoke\.yaml\s+/etc/invoke\.yaml$")
    i_pkg = index(runtime, "COPY", r"^\.\s+/opt/dlenv/?$")
    i_ws = index(runtime, "COPY", r"^workspace/?\s+/root/workspace/?$")
    assert i_env < i_check < min(i_conf, i_pkg, i_ws), "code must come after the env and its check"
    # /etc/invoke.yaml's search root is where the package (and its tasks.py) is copied
    conf = yaml.safe_load((ROOT / "docker" / "etc" / "invoke.yaml").read_text(encoding="utf-8"))
    assert conf["tasks"]["search_root"] == "/opt/dlenv" and (ROOT / "tasks.py").is_file()
    assert not any(i == "COPY" and "/root/tasks.py" in a for i, a in runtime), "a second tasks file would drift"
    install = runtime[index(runtime, "RUN", r"pip install")][1]
    assert "-e /opt/dlenv" in install and "--no-deps" in install and "--no-cache-dir" in install
    assert "--no-build-isolation" in install  # isolation would fetch setuptools: no network at this step
    assert index(runtime, "RUN", r"pip install") > i_pkg
    assert "invoke --list" in install


def test_workdir_entrypoint_and_labels():
    runtime = STAGES["runtime"]
    workdirs = [a for i, a in runtime if i == "WORKDIR"]
    assert workdirs[-1] == "/root/workspace"
    entry = entrypoint()
    assert entry[0].endswith("/tini") and "--" in entry
    assert entry[-1] == "/usr/local/bin/dlenv-entrypoint"
    index(runtime, "COPY", r"scripts/tools/entrypoint\.sh\s+/usr/local/bin/dlenv-entrypoint")
    labels = " ".join(a for i, a in runtime if i == "LABEL")
    for key in ("title", "description", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels


def test_tini_signals_only_its_child():
    # -g would signal the whole process group: DataLoader workers die before the trainer saves
    flags = entrypoint()[1:entrypoint().index("--")]
    assert "-g" not in flags and not any(f.startswith("-") and "g" in f[1:] for f in flags), flags


def test_runtime_stage_uses_no_apt_and_leaves_no_pip_cache():
    runs = [a for i, a in STAGES["runtime"] if i == "RUN"]
    assert not any("apt-get" in r for r in runs)
    assert all("--no-cache-dir" in r for r in runs if "pip install" in r)


# ---------------------------------------------------------------------------------------------------
# The build check script, run here against this lane's packages


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / "check_build.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_build_check_loads_torchvisions_and_torchaudios_native_parts():
    import importlib.util

    import torch

    r = _check("--cuda", str(torch.version.cuda))
    if importlib.util.find_spec("torchaudio") is None:  # the newest lane installs no torchaudio
        assert r.returncode == 1 and r.stderr.strip() == "build check: No module named 'torchaudio'", r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert "torchvision" in r.stdout and "(io, ops)" in r.stdout and "torchaudio" in r.stdout


def test_build_check_fails_for_torch_of_another_cuda():
    r = _check("--cuda", "11.6-nonexistent", "--env-file", "environment.yml")
    assert r.returncode == 1
    assert "is built for CUDA" in r.stderr and "not 11.6-nonexistent" in r.stderr and "environment.yml" in r.stderr


def test_build_check_source_covers_decode_nms_and_torchaudio():
    text = (ROOT / "scripts" / "tools" / "check_build.py").read_text(encoding="utf-8")
    for needle in ("io.decode_jpeg(io.encode_jpeg(", "ops.nms(", "AF.lfilter(", "torch.from_numpy(", "import cv2"):
        assert needle in text


# ---------------------------------------------------------------------------------------------------
# .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore matching: '*' stays within a path segment, '**' spans any number."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):  # any number of leading folders, including none
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + "$")


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves out `path`: the last pattern matching it or a parent wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        rx = _pattern_regex(pattern.strip("/"))
        if any(rx.match(c) for c in candidates):
            result = not negate
    return result


def dockerignore() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.is_file():
        pytest.skip(".dockerignore is not shipped here")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_dockerignore_keeps_what_the_image_copies_and_mounts():
    patterns = dockerignore()
    needed = ["environment.yml", "environment.modern.yml", "requirements.txt", "requirements-dev.txt",
              "pyproject.toml", "README.md", "tasks.py", "scripts/tools/entrypoint.sh",
              "scripts/tools/check_build.py", "scripts/tools/lock_env.py", "docker/etc/invoke.yaml",
              "src/dlenv/__init__.py", "src/dlenv/envcheck/pins.py", "tests/conftest.py", "tests/container/conftest.py",
              "workspace/README.md", "workspace/data/README.md"]
    kept_out = [p for p in needed if ignored(p, patterns)]
    assert not kept_out, f".dockerignore drops files the image needs: {kept_out}"


def test_dockerignore_drops_caches_data_history_and_keys():
    patterns = dockerignore()
    junk = [".git/HEAD", ".venv/bin/python", "src/dlenv/__pycache__/cli.cpython-310.pyc",
            "src/dlenv.egg-info/PKG-INFO", "workspace/data/pets/train/cat/1.jpg", "workspace/runs/exp/last.pth",
            "runs/exp/last.pth", "tests/__pycache__/x.pyc", ".pytest_cache/v/cache/lastfailed",
            ".dlenv/key", "workspace/.dlenv/key"]
    leaked = [p for p in junk if not ignored(p, patterns)]
    assert not leaked, f"the build context would carry {leaked}"


def test_ignore_matcher_itself():
    assert ignored("a/b/__pycache__/x.pyc", ["**/__pycache__"])
    assert not ignored("src/x.py", ["*", "!src/"])
    assert ignored("workspace/data/x", ["*", "!workspace/", "workspace/data/*"])
    assert not ignored("workspace/data/README.md", ["*", "!workspace/", "workspace/data/*",
                                                    "!workspace/data/README.md"])


# ---------------------------------------------------------------------------------------------------
# The entrypoint script alone (tests/test_entrypoint.py runs it under tini, with signals and --user)


def test_entrypoint_gives_a_user_without_home_a_writable_one(tmp_path):
    script = ROOT / "scripts" / "tools" / "entrypoint.sh"
    env = {**os.environ, "HOME": "/nonexistent/home"}
    out = subprocess.run(["bash", str(script), "sh", "-c", 'echo "$HOME"; test -w "$HOME"'],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"/tmp/home-{os.getuid()}"
    env["HOME"] = str(tmp_path)  # a writable HOME is left alone, and the command's status comes back
    out = subprocess.run(["bash", str(script), "sh", "-c", 'echo "$HOME"; exit 3'],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 3 and out.stdout.strip() == str(tmp_path)


@pytest.mark.parametrize("given, want", [({}, "passwd"), ({"USER": "ann", "LOGNAME": "ann"}, "ann")])
def test_entrypoint_names_the_user_for_getpass(tmp_path, given, want):
    import pwd

    script = ROOT / "scripts" / "tools" / "entrypoint.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME")} | given | {"HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(script), sys.executable, "-c",
                          "import getpass, json, os; print(json.dumps([getpass.getuser(), os.environ['USER'], "
                          "os.environ['LOGNAME']]))"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    name = pwd.getpwuid(os.getuid()).pw_name if want == "passwd" else want
    assert json.loads(out.stdout) == [name, name, name]


def test_docs_say_what_was_verified_here_and_what_needs_an_engine():
    text = DOCS.read_text(encoding="utf-8")
    assert "## What is verified where" in text
    section = text.split("## What is verified where", 1)[1]
    assert "only a real engine" in section.lower() and "tests/test_entrypoint.py" in section


def test_docs_lead_with_dlenv_verbs():
    text = DOCS.read_text(encoding="utf-8")
    first = re.search(r"^docker run .*$", text, re.M).group(0)
    assert " dlenv " in first + " ", first
    assert "invoke -r ." in text  # the project's own tasks, in the one documented way


# ---------------------------------------------------------------------------------------------------
# CI's image lane (.ci/image-lane): it must keep the host's network alone and every container off it


def test_ci_runs_the_image_lane_once_after_the_host_lanes_with_a_switch():
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    calls = [ln for ln in run.splitlines() if ".ci/image-lane" in ln and not ln.lstrip().startswith("#")]
    assert len(calls) == 1 and "DLENV_CI_IMAGE" in calls[0], calls
    assert run.index(calls[0]) > run.rindex("lane newest")


def test_the_image_lane_starts_dockerd_without_networking_and_builds_and_runs_with_none():
    lane = (ROOT / ".ci" / "image-lane").read_text(encoding="utf-8").replace("\\\n", " ")
    dockerd = re.search(r"/usr/sbin/dockerd (--[^>]*)>", lane).group(1)
    for flag in ("--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none"):
        assert flag in dockerd, flag
    assert "trap stop_engine EXIT" in lane and 'kill -TERM "$dockerd_pid"' in lane
    commands = re.findall(r'"\$docker" (build|run)\b([^\n]*)', lane)
    assert commands and all("--network none" in args for _, args in commands), commands
    # the contract's own containers: the SDK's and the terminal's
    container = (ROOT / "tests" / "container" / "test_image.py").read_text(encoding="utf-8")
    assert 'network_mode="none"' in container and '"--network", "none"' in container
    assert "containers.run(" not in container  # every container goes through start(), which sets it


# ---------------------------------------------------------------------------------------------------
# The lock's conda half (scripts/tools/lock_env.py conda KIND FILE), as the runtime stage runs it


@pytest.mark.parametrize("kind", ["conda", "pip"])
def test_the_conda_lock_follows_the_env_kind_and_a_missing_conda_fails_plainly(tmp_path, kind):
    out = tmp_path / "conda-explicit.txt"
    env = {**os.environ, "PATH": str(tmp_path)}  # no conda anywhere on it
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / "lock_env.py"), "conda", kind, str(out)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert "Traceback" not in r.stderr
    if kind == "conda":  # a conda image without conda is a broken build, never a silent skip
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "no conda on PATH" in r.stderr and "ENV_KIND=pip" in r.stderr
    else:
        assert r.returncode == 0 and "pip.txt is the lock" in r.stdout, r.stderr
    assert not out.exists()


def test_the_conda_lock_refuses_an_unknown_kind():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / "lock_env.py"), "conda", "mamba", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("usage: lock_env.py"), r.stderr


def test_the_lock_holds_the_pytorch_stack_at_its_exact_version_string():
    """PIP_CONSTRAINT's lines admit the installed build only: `torch==1.13.1` would also take `1.13.1+evil`."""
    from importlib import metadata

    from packaging.requirements import Requirement

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / "lock_env.py"), "constraints"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert any(line.startswith("torch=") for line in lines), lines
    for line in lines:
        req = Requirement(line)
        installed = metadata.version(req.name)
        assert req.specifier.contains(installed) and not req.specifier.contains(installed.split("+")[0] + "+evil")
