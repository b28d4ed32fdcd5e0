"""Training twice in one Jupyter kernel, after an out-of-memory, as a notebook user does (issue 46).

The image ships JupyterLab with the `dl` env as its kernel. A kernel keeps the last exception
(sys.last_value), and with it the frames of the step that raised it: before the trainer freed a failed
step, a second run in the same kernel peaked at the whole card. nbclient runs the notebook in a real
kernel, cell by cell, as JupyterLab would.
"""

from __future__ import annotations

import json

import gpushare
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_a_kernel_gets_its_memory_back_after_each_out_of_memory_and_trains_with_the_same_peak(tmp_path):
    """Three tries in one kernel, as a notebook user makes them (issue 54) on a 24 GiB card (PyTorch's
    per-process cap: the out-of-memory comes as on such a card): a batch that does not fit, one that does, the
    first again. After each failure the bytes allocated are within 64 MiB of what they were
    before the first cell, although the kernel keeps the last exception; the runs that fit report the same
    peak. A run that fits comes first, so that neither compared run pays cuDNN's autotuning."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    setup = """
import json, torch
from dlenv.options import config
from dlenv.options.config import TrainConfig
from dlenv.train import train
torch.cuda.init()
card = min(AS_ON, torch.cuda.get_device_properties(0).total_memory / 2**30)  # GiB: the user's card
torch.cuda.set_per_process_memory_fraction(card * 2**30 / torch.cuda.get_device_properties(0).total_memory)
before = torch.cuda.memory_allocated()
base = dict(synthetic=True, device="cuda", workers=0, epochs=1, max_steps=6, project="runs", amp=True)
huge = int(card / 21 * 256 * 2)  # ResNet-50 fp32 at 224 px needs about 21 GiB per 256: twice the card
""".replace("AS_ON", str(gpushare.AS_ON))
    oom = "train(config.build(TrainConfig, **{**base, 'model': 'resnet50', 'img_size': 224, 'amp': False, " \
          "'batch_size': huge, 'max_steps': 1}))"
    held = "print('HELD', json.dumps(torch.cuda.memory_allocated() - before))"
    fits = "out = train(config.build(TrainConfig, **base, model='resnet50', img_size=176, batch_size=96))\n" \
           "print('RESULT', json.dumps({'peak': out['peak_alloc_gib'], 'img_s': out['img_per_s']}))"
    failing = {"tags": ["raises-exception"]}  # shown, and kept by the kernel (sys.last_value)
    nb = nbformat.v4.new_notebook()
    warm = "train(config.build(TrainConfig, **base, model='resnet50', img_size=176, batch_size=96))"
    nb.cells = [nbformat.v4.new_code_cell(setup), nbformat.v4.new_code_cell(warm),  # cuDNN's autotuning, paid once
                nbformat.v4.new_code_cell(oom, metadata=failing), nbformat.v4.new_code_cell(held),
                nbformat.v4.new_code_cell(fits),
                nbformat.v4.new_code_cell(oom, metadata=failing), nbformat.v4.new_code_cell(held),
                nbformat.v4.new_code_cell(fits)]
    with gpushare.place():  # the kernel fills a 24 GiB card of its own: one of the card's places
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()

    def said(cell, key):
        text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        return json.loads(text.split(f"{key} ", 1)[1].splitlines()[0])

    for i in (2, 5):
        assert any(o.get("ename") == "UserError" or "out of memory" in str(o.get("evalue", "")).lower()
                   for o in nb.cells[i].outputs), nb.cells[i].outputs
    held_after = [said(nb.cells[i], "HELD") for i in (3, 6)]
    assert all(abs(h) <= 64 * 2**20 for h in held_after), \
        f"bytes still allocated after each out-of-memory (the kernel keeps the exception): {held_after}"
    a, b = (said(nb.cells[i], "RESULT") for i in (4, 7))
    assert a["peak"] < 16, f"peak {a['peak']:.1f} GiB in a kernel that hit an out-of-memory, for a run that needs ~3"
    assert abs(a["peak"] - b["peak"]) <= 0.05 * b["peak"]
    # both runs trained (their speed is no measure here: the tests beside this one share the card, and an
    # H100 run read 883 against 2,317 img/s; the same speed after an out-of-memory is checked with the
    # card alone, test_train_gpu.py::test_two_runs_after_a_real_out_of_memory_report_the_same_peak_and_speed)
    assert a["img_s"] > 0 and b["img_s"] > 0
