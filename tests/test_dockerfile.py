"""The Dockerfile and .dockerignore, checked by reading them (no Docker engine needed).

The Dockerfile is parsed into stages and instructions, and what the image promises is asserted on
that structure: the order of layers (env before code), what each RUN does together, what the
runtime stage ends with, and that the files it copies survive .dockerignore.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DIGEST = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")

if not DOCKERFILE.is_file():
    pytest.skip("the Dockerfile is not shipped here", allow_module_level=True)


def parse(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(parser directives, [(INSTRUCTION, arguments)]) with continuations joined and comments dropped."""
    directives, instructions, current = [], [], ""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not instructions and not current and re.match(r"#\s*\w+=", stripped) and i == len(directives):
            directives.append(stripped.lstrip("#").strip())
            continue
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        word, _, rest = current.partition(" ")
        instructions.append((word.upper(), rest.strip()))
        current = ""
    return directives, instructions


DIRECTIVES, INSTRUCTIONS = parse(DOCKERFILE.read_text(encoding="utf-8"))


def stages() -> dict[str, list[tuple[str, str]]]:
    """{stage name: its instructions after FROM}; the global ARGs before the first FROM under ''."""
    out: dict[str, list] = {"": []}
    name = ""
    for instr, args in INSTRUCTIONS:
        if instr == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            name = m.group(2) or f"stage{len(out)}"
            out[name] = [("FROM", m.group(1))]
        else:
            out[name].append((instr, args))
    return out


STAGES = stages()


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


def test_syntax_directive_allows_add_checksum():
    (directive,) = [d for d in DIRECTIVES if d.startswith("syntax=")]
    version = re.search(r"dockerfile:(\d+)\.(\d+)", directive)
    assert version and (int(version.group(1)), int(version.group(2))) >= (1, 6)


def test_base_image_is_pinned_by_tag_and_digest_with_a_refresh_recipe():
    base = arg_default(STAGES[""], "BASE_IMAGE")
    assert DIGEST.match(base), f"BASE_IMAGE {base} is not tag@sha256:digest"
    assert "11.6" in base.split("@")[0] and "cudnn" in base
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "docker buildx imagetools inspect" in text
    # the modern profile's base, given in the header for copy and paste, is pinned the same way
    modern = re.search(r"modern base:\s*(\S+)", text)
    assert modern and DIGEST.match(modern.group(1)) and ":12." in modern.group(1)


def test_two_stages_on_the_same_base_and_runtime_last():
    names = [n for n in STAGES if n]
    assert names == ["builder", "runtime"]
    assert all(STAGES[n][0][1] == "${BASE_IMAGE}" for n in names)
    runtime = STAGES["runtime"]
    i_copy = index(runtime, "COPY", r"--from=builder\s+/opt/conda\s+/opt/conda")
    assert all(not (i == "COPY" and "--from" in a) for i, a in runtime[i_copy + 1:])


@pytest.mark.parametrize("stage", ["builder", "runtime"])
def test_shell_has_pipefail_before_any_run(stage):
    body = STAGES[stage]
    i_shell = index(body, "SHELL", r"pipefail")
    assert json.loads(body[i_shell][1])[:3] == ["/bin/bash", "-o", "pipefail"]
    assert all(i != "RUN" for i, _ in body[:i_shell])


def test_miniforge_download_is_checksummed_and_cleaned_in_the_same_run():
    builder = STAGES["builder"]
    i_add = index(builder, "ADD", r"--checksum=sha256:")
    assert "miniforge" in builder[i_add][1].lower()
    assert re.fullmatch(r"[0-9a-f]{64}", arg_default(builder, "MINIFORGE_SHA256"))
    run = builder[index(builder, "RUN", r"miniforge\.sh -b -p /opt/conda")][1]
    assert "rm /tmp/miniforge.sh" in run and "conda clean -afy" in run
    assert "tini=" in run  # the ENTRYPOINT's binary comes from here


def test_env_is_created_from_the_env_file_alone_and_cleaned_in_the_same_run():
    builder = STAGES["builder"]
    i_run = index(builder, "RUN", r"conda env create")
    run = builder[i_run][1]
    assert "conda clean -afy" in run and "--name dl" in run and "${ENV_FILE}" in run
    copies = [a for i, a in builder[:i_run] if i == "COPY"]
    assert copies == ["${ENV_FILE} requirements.txt /tmp/env/"], "only the env file may feed the env layer"
    assert arg_default(builder, "ENV_FILE") == "environment.yml"


def test_build_fails_for_a_cpu_torch_or_another_cuda():
    runtime = STAGES["runtime"]
    check = runtime[index(runtime, "RUN", r"torch\.version\.cuda")][1]
    assert 'os.environ["TORCH_CUDA"]' in check and "sys.exit" in check
    # the default expected CUDA is environment.yml's pytorch-cuda pin
    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    cuda = next(d.split("=")[1] for d in env["dependencies"] if isinstance(d, str) and "pytorch-cuda=" in d)
    assert arg_default(runtime, "TORCH_CUDA") == cuda


def test_modern_build_command_matches_the_modern_env_file():
    env = yaml.safe_load((ROOT / "environment.modern.yml").read_text(encoding="utf-8"))
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    local = re.search(r"torch==[\d.]+\+cu(\d+)(\d)", " ".join(pip))
    want = f"{local.group(1)}.{local.group(2)}"
    sources = [DOCKERFILE] + [p for p in (ROOT / "docs" / "docker.md",) if p.is_file()]
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
    bashrc = runtime[index(runtime, "RUN", r"bash\.bashrc")][1]
    assert "conda activate dl" in bashrc and "chmod 755 /root" in bashrc


def test_code_is_copied_after_the_env_and_the_tasks_are_found_from_the_workspace():
    runtime = STAGES["runtime"]
    i_env = index(runtime, "COPY", r"--from=builder")
    i_check = index(runtime, "RUN", r"torch\.version\.cuda")
    i_tasks = index(runtime, "COPY", r"^tasks\.py\s+/root/tasks\.py$")
    i_pkg = index(runtime, "COPY", r"^\.\s+/opt/dlenv/?$")
    i_ws = index(runtime, "COPY", r"^workspace/?\s+/root/workspace/?$")
    assert i_env < i_check < min(i_tasks, i_pkg, i_ws), "code must come after the env and its check"
    install = runtime[index(runtime, "RUN", r"pip install")][1]
    assert "-e /opt/dlenv" in install and "--no-deps" in install and "--no-cache-dir" in install
    assert index(runtime, "RUN", r"pip install") > i_pkg
    assert "invoke --list" in install


def test_workdir_entrypoint_and_labels():
    runtime = STAGES["runtime"]
    workdirs = [a for i, a in runtime if i == "WORKDIR"]
    assert workdirs[-1] == "/root/workspace"
    (entry,) = [json.loads(a) for i, a in runtime if i == "ENTRYPOINT"]
    assert entry[0].endswith("/tini") and "--" in entry
    assert entry[-1] == "/usr/local/bin/dlenv-entrypoint"
    index(runtime, "COPY", r"scripts/entrypoint\.sh\s+/usr/local/bin/dlenv-entrypoint")
    labels = " ".join(a for i, a in runtime if i == "LABEL")
    for key in ("title", "description", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels


def test_runtime_stage_uses_no_apt_and_leaves_no_pip_cache():
    runs = [a for i, a in STAGES["runtime"] if i == "RUN"]
    assert not any("apt-get" in r for r in runs)
    assert all("--no-cache-dir" in r for r in runs if "pip install" in r)


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


def test_dockerignore_keeps_what_the_image_copies():
    patterns = dockerignore()
    needed = ["environment.yml", "environment.modern.yml", "requirements.txt", "requirements-dev.txt",
              "pyproject.toml", "README.md", "tasks.py", "scripts/entrypoint.sh", "src/dlenv/__init__.py",
              "src/dlenv/envcheck.py", "tests/conftest.py", "tests/container/conftest.py",
              "workspace/README.md", "workspace/data/README.md"]
    kept_out = [p for p in needed if ignored(p, patterns)]
    assert not kept_out, f".dockerignore drops files the image needs: {kept_out}"


def test_dockerignore_drops_caches_data_and_history():
    patterns = dockerignore()
    junk = [".git/HEAD", ".venv/bin/python", "src/dlenv/__pycache__/cli.cpython-310.pyc",
            "src/dlenv.egg-info/PKG-INFO", "workspace/data/pets/train/cat/1.jpg", "workspace/runs/exp/last.pth",
            "runs/exp/last.pth", "tests/__pycache__/x.pyc", ".pytest_cache/v/cache/lastfailed"]
    leaked = [p for p in junk if not ignored(p, patterns)]
    assert not leaked, f"the build context would carry {leaked}"


def test_ignore_matcher_itself():
    assert ignored("a/b/__pycache__/x.pyc", ["**/__pycache__"])
    assert not ignored("src/x.py", ["*", "!src/"])
    assert ignored("workspace/data/x", ["*", "!workspace/", "workspace/data/*"])
    assert not ignored("workspace/data/README.md", ["*", "!workspace/", "workspace/data/*",
                                                    "!workspace/data/README.md"])


# ---------------------------------------------------------------------------------------------------
# The entrypoint script


def test_entrypoint_gives_a_user_without_home_a_writable_one(tmp_path):
    script = ROOT / "scripts" / "entrypoint.sh"
    env = {**os.environ, "HOME": "/nonexistent/home"}
    out = subprocess.run(["bash", str(script), "sh", "-c", 'echo "$HOME"; test -w "$HOME"'],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"/tmp/home-{os.getuid()}"
    env["HOME"] = str(tmp_path)  # a writable HOME is left alone, and the command's status comes back
    out = subprocess.run(["bash", str(script), "sh", "-c", 'echo "$HOME"; exit 3'],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 3 and out.stdout.strip() == str(tmp_path)
