"""Training twice in one Jupyter kernel, after an out-of-memory, as a notebook user does (issue 46).

The image ships JupyterLab with the `dl` env as its kernel. A kernel keeps the last exception
(sys.last_value), and with it the frames of the step that raised it: before the trainer freed a failed
step, a second run in the same kernel peaked at the whole card. nbclient runs the notebook in a real
kernel, cell by cell, as JupyterLab would.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu, pytest.mark.slow]


def test_a_kernel_trains_twice_after_an_out_of_memory_with_the_same_peak(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    setup = """
import json, torch
from dlenv.options import config
from dlenv.options.config import TrainConfig
from dlenv.train import train
base = dict(synthetic=True, device="cuda", workers=0, epochs=1, max_steps=6, project="runs", amp=True)
huge = int(torch.cuda.get_device_properties(0).total_memory / 2**30 / 21 * 256 * 2)  # twice the card, fp32
"""
    oom = "train(config.build(TrainConfig, **{**base, 'model': 'resnet50', 'img_size': 224, 'amp': False, " \
          "'batch_size': huge, 'max_steps': 1}))"
    run = "out = train(config.build(TrainConfig, **base, model='resnet50', img_size=176, batch_size=96))\n" \
          "print('RESULT', json.dumps({'peak': out['peak_alloc_gib'], 'img_s': out['img_per_s']}))"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(setup),
                nbformat.v4.new_code_cell(oom, metadata={"tags": ["raises-exception"]}),  # shown, kept by the kernel
                nbformat.v4.new_code_cell(run), nbformat.v4.new_code_cell(run)]
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert any(o.get("ename") == "UserError" or "out of memory" in str(o.get("evalue", "")).lower()
               for o in nb.cells[1].outputs), nb.cells[1].outputs
    got = []
    for cell in nb.cells[2:]:
        text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        got.append(json.loads(text.split("RESULT ", 1)[1].splitlines()[0]))
    a, b = got
    assert a["peak"] < 16, f"peak {a['peak']:.1f} GiB in a kernel that hit an out-of-memory, for a run that needs ~3"
    assert abs(a["peak"] - b["peak"]) <= 0.05 * b["peak"]
    assert a["img_s"] > 0.5 * b["img_s"]
