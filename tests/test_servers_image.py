"""Inside the built image (marker `image`): the notebook server's parts as the image installs them.
workspace/quickstart.ipynb executes headless (nbclient, as `jupyter nbconvert --execute` does) on a CPU
without an error, drawing its curves and val's confusion matrix; the lab's default kernel is the `dl` env's
Python. tests/container/test_lab_and_tensorboard.py runs the servers themselves in running containers."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.image

NOTEBOOK = Path(os.environ.get("DLENV_WORKSPACE", "/root/workspace")) / "quickstart.ipynb"
SHIPPED = "PER_CLASS, EPOCHS = 100, 8"


def test_the_quickstart_notebook_executes_headless(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    assert NOTEBOOK.is_file(), f"{NOTEBOOK} is not in the image"
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)  # the image's workspace stays as shipped
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # on a CPU, as in CI, wherever the image runs
    nb = nbformat.read(tmp_path / NOTEBOOK.name, as_version=4)
    # its one parameters line made small (the shipped values train for about a minute on two quiet cores);
    # every cell runs as shipped otherwise
    (params,) = [c for c in nb.cells if c.cell_type == "code" and SHIPPED in c.source]
    params.source = params.source.replace(SHIPPED, "PER_CLASS, EPOCHS = 20, 2")
    # raises CellExecutionError, with the cell and its traceback, for any cell that fails
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    run = tmp_path / "runs" / "quickstart"
    assert len((run / "results.csv").read_text().splitlines()) == 1 + 2  # the header and 2 epochs
    assert list(run.glob("events.out.tfevents.*"))  # tensorboard=True: what `dlenv tensorboard` serves
    assert (run / "val" / "confusion_matrix.csv").is_file()
    figures = [c for c in nb.cells if c.cell_type == "code"
               and any("image/png" in o.get("data", {}) for o in c.outputs)]
    # the curves (plt.show inline, not the image's MPLBACKEND=Agg) and the confusion matrix
    assert len(figures) == 2, [c.source[:40] for c in figures]
    tables = [c for c in nb.cells if c.cell_type == "code" and any("text/html" in o.get("data", {}) for o in c.outputs)]
    assert len(tables) == 2  # results.csv and the confusion matrix as tables


def test_the_default_kernel_is_the_dl_envs_python():
    from jupyter_client.kernelspec import KernelSpecManager

    # the Dockerfile's spec: the env's Python by its full path (whatever PATH a user's shell has), named so
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == "/opt/conda/envs/dl/bin/python" and spec.display_name == "Python 3 (dl)", spec.argv
    assert os.path.realpath(spec.argv[0]) == os.path.realpath(sys.executable)
