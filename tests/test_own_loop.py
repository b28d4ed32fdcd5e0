"""docs/own-loop.md: its loop runs as written, uses the parts it names, and leaves a loadable file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv.files.runstate import load_state

ROOT = Path(__file__).resolve().parents[1]


def _code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "own-loop.md").read_text(), re.S)
    assert len(blocks) == 1, "own-loop.md holds one program"
    return blocks[0]


def test_the_loop_uses_dlenvs_parts_and_stays_short():
    code = _code()
    for part in ("Precision(", "apply_checkpointing(", "MemoryMonitor(", ".generate_report()", "save_state(",
                 "precision.autocast()", "precision.backward(", "precision.step(", "/ accum_steps"):
        assert part in code, part
    assert len(code.splitlines()) <= 60


@pytest.mark.slow  # 6 s on 2 cores; the quick set checks the example's parts above
def test_the_loop_runs_as_written(tmp_path):
    (tmp_path / "own_loop.py").write_text(_code())
    # one thread: the example is tiny, and thread contention with other tests costs more than it gives
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "own_loop.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert re.search(r"^8 blocks checkpointed, (fp32 on cpu|bf16 on cuda|fp16 on cuda)$", r.stdout, re.M)
    assert [int(n) for n in re.findall(r"^iter (\d+): loss", r.stdout, re.M)] == [4, 8, 12]
    report = r.stdout[r.stdout.index("samples"):]
    assert all(re.search(rf"^{phase}\s+{n}\b", report, re.M) for phase, n in
               (("forward", 24), ("backward", 24), ("step", 12)))
    state = load_state(tmp_path / "runs" / "own-loop" / "last.pth")  # weights_only, floats restored
    assert state["iter"] == 12 and "layer1.0.conv1.weight" in state["model"]
    assert isinstance(state["optimizer"]["param_groups"][0]["lr"], float)
    # the file and its MAC sidecar (dlenv.files.weights): no temporary file left behind
    assert sorted(p.name for p in tmp_path.joinpath("runs", "own-loop").iterdir()) == ["last.pth"]
