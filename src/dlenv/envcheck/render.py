"""The screen verify-env prints (one line per check, its fix under it) and the same as JSON."""

from __future__ import annotations

import dataclasses
import json

from dlenv.envcheck.facts import Facts
from dlenv.envcheck.judge import Check
from dlenv.envcheck.pins import profile_name


def render_text(facts: Facts, results: list[Check], line: str | None = None) -> str:
    """The screen: a header, one line per check (and its fix under it), then `line` if given."""
    profile = profile_name(facts.pins)
    where = f"profile {profile} ({facts.env_file})" if profile else "no image profile matches this torch"
    head = f"dlenv verify-env · {where}" + (" · in a container" if facts.in_container else "")
    rows = [head]
    for c in results:
        rows.append(f"{c.status:<5} {c.name:<12} {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            rows.append(f"{'':<5} {'':<12} -> {c.fix}")
    if line:
        rows.append(line)
    return "\n".join(rows)


def render_json(facts: Facts, results: list[Check], ok: bool, line: str) -> str:
    """Everything as JSON: ok, verdict, profile, the checks and the raw facts."""
    return json.dumps({"ok": ok, "verdict": line, "profile": profile_name(facts.pins),
                       "checks": [dataclasses.asdict(c) for c in results],
                       "facts": dataclasses.asdict(facts)}, indent=2)
