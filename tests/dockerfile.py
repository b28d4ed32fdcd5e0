"""The Dockerfile as data, for tests that check it by reading and tests that run its parts on the host.

`STAGES` holds each stage's instructions; `host_path` maps a path inside the image back to the file of
this checkout that a COPY puts there, so a test can run the image's ENTRYPOINT, or read its
/etc/invoke.yaml, exactly as the Dockerfile writes them (importable as `dockerfile` from any test).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


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


def stages(instructions: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """{stage name: its instructions after FROM}; the global ARGs before the first FROM under ''."""
    out: dict[str, list] = {"": []}
    name = ""
    for instr, args in instructions:
        if instr == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            name = m.group(2) or f"stage{len(out)}"
            out[name] = [("FROM", m.group(1))]
        else:
            out[name].append((instr, args))
    return out


DIRECTIVES, INSTRUCTIONS = parse(DOCKERFILE.read_text(encoding="utf-8")) if DOCKERFILE.is_file() else ([], [])
STAGES = stages(INSTRUCTIONS)


def copies(stage: str = "runtime") -> list[tuple[list[str], str]]:
    """([sources], destination) of each COPY from the build context (not --from) in `stage`."""
    out = []
    for instr, args in STAGES.get(stage, []):
        if instr != "COPY":
            continue
        words = shlex.split(args)
        if any(w.startswith("--from") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        out.append((paths[:-1], paths[-1]))
    return out


def host_path(image_path: str, stage: str = "runtime") -> Path | None:
    """The file of this checkout that the Dockerfile copies to `image_path`, or None.

    A COPY to a file path maps that path; a COPY of a folder (or of '.') to a folder maps everything
    under it. The last COPY that covers the path wins, as in the image.
    """
    found = None
    for sources, dest in copies(stage):
        if len(sources) == 1 and not dest.endswith("/") and dest == image_path:
            found = ROOT / sources[0]
        elif dest.endswith("/") or len(sources) > 1:
            base = dest.rstrip("/") + "/"
            for src in sources:
                src_path = ROOT / src
                if src_path.is_dir() and image_path.startswith(base):
                    candidate = src_path / image_path[len(base):]
                    if candidate.exists():
                        found = candidate
                elif image_path == base + Path(src).name:
                    found = src_path
    return found


def entrypoint() -> list[str]:
    """The runtime stage's ENTRYPOINT (exec form)."""
    (entry,) = [json.loads(a) for i, a in STAGES["runtime"] if i == "ENTRYPOINT"]
    return entry


def host_entrypoint() -> list[str]:
    """The ENTRYPOINT with each image path replaced by this checkout's file, or by the program of the same
    name on PATH for what the image installs rather than copies (tini). Raises LookupError for a
    program that is not there, naming it."""
    out = []
    for word in entrypoint():
        if not word.startswith("/"):
            out.append(word)
            continue
        local = host_path(word)
        if local is None:
            found = shutil.which(Path(word).name)
            if found is None:
                raise LookupError(Path(word).name)
            local = Path(found)
        out.append(str(local))
    return out
