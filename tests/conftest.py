"""Shared test setup: marker handling, tiny datasets and a project of one's own models.

- `gpu` tests run only where CUDA is available; `image` tests only inside the built image
  (DLENV_IMAGE=1, set by the Dockerfile); `tests/container` runs only with `--image NAME`.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import gpushare
import pytest
from imagedata import make_image_folder
from usermodels import isolated_imports, write_project

# A test run started in the background by a shell (`bash .ci/run &`, a CI runner's job) inherits SIGINT
# ignored, and so would every process a test starts: a Ctrl-C test would signal a child that cannot hear
# it. Python's own handler here (an xdist worker runs this too) leaves exec'd children the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _fresh_invocation(monkeypatch):
    """Forget how a previous test started dlenv (dlenv.invocation keeps it in the environment). No
    consent to unpickle is given here: loads take an explicit dlenv.files.weights.LoadPolicy, and the files the
    tests write (state dicts, dlenv checkpoints) pass its allowlist as users' files do."""
    monkeypatch.setenv("DLENV_COMMAND", "")


@pytest.fixture(autouse=True)
def _no_stop_carried_over(monkeypatch):
    """A stop signal a test raised (dlenv.errors.stop notes it for the process) is not taken by the next
    test for one its command swallowed."""
    from dlenv import errors

    monkeypatch.setattr(errors, "_stops", [])


@pytest.fixture(autouse=True)
def _own_cache_folder(tmp_path_factory, monkeypatch):
    """Tests (and the dlenv processes they start) keep dlenv's per-machine verdicts (the CPU AMP check)
    in a folder of their own, never the machine's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


@pytest.fixture(autouse=True)
def _gpu_memory_census(request):
    """DLENV_GPU_CENSUS=FILE: for each GPU test, the CUDA memory its tensors still hold after it (live
    tensors after gc, not the allocator's cache) appended to FILE, to find what one run leaves for the
    next in one process (a notebook, --batch-size auto then training, a test session)."""
    out = os.environ.get("DLENV_GPU_CENSUS")
    if not out or "gpu" not in request.keywords or not _cuda_available():
        yield
        return
    import gc

    import torch

    gc.collect()
    before = torch.cuda.memory_allocated()
    yield
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    with open(out, "a", encoding="utf-8") as fh:
        fh.write(f"{(after - before) / 2**20:10.1f} MiB left ({after / 2**30:.2f} GiB live, "
                 f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved)  {request.node.nodeid}\n")


@pytest.fixture(autouse=True)
def _one_gpu_shared_by_workers(request):
    """The workers of `pytest -m gpu -n 4` share one GPU; a `whole_gpu` test has it alone (gpushare.py)."""
    if "gpu" not in request.keywords:
        yield
        return
    with gpushare.share("whole_gpu" in request.keywords, request.node.nodeid):
        yield


def pytest_addoption(parser):
    parser.addoption("--image", default=None, help="image to test in tests/container (e.g. dlenv:cu116)")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    in_image = os.environ.get("DLENV_IMAGE") == "1"
    has_cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if has_cuda is None:
                has_cuda = _cuda_available()
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "image" in item.keywords and not in_image:
            item.add_marker(pytest.mark.skip(reason="needs the built dlenv image"))
    items[:] = sorted(items, key=_gpu_order)  # stable: every other test keeps its place


def _gpu_order(item) -> int:
    """The GPU suite's order on its shared card (gpushare.py): the long ones first (the bench-memory table and
    the tests that read it, the notebook, a torch.compile's first compile of 20 to 40 s), so that the workers
    finish together, and a `whole_gpu` test last, when no long shared test can keep it waiting at the
    turnstile while the others wait behind it."""
    if "gpu" not in item.keywords:
        return 1
    if "whole_gpu" in item.keywords:
        return 2
    group = item.get_closest_marker("xdist_group")
    long = "slow" in item.keywords or "compile" in item.name or (group and group.args == ("bench_memory_gpu",))
    return 0 if long else 1


@pytest.fixture
def image_folder(tmp_path):
    """A train/ + val/ dataset of two classes with a few tiny images each."""
    make_image_folder(tmp_path / "ds" / "train", per_class=6)
    make_image_folder(tmp_path / "ds" / "val", per_class=3, seed=1)
    return tmp_path / "ds"


# ---------------------------------------------------------------------------------------------------
# The tiny models (tests/tinymodels.py) in place of torchvision's, and the data they train on.


@pytest.fixture
def tiny(monkeypatch):
    """dlenv.model.models.build_model builds tinymodels.Tiny (`build_tiny`), and so does models.architecture when
    a run file of it is opened again (val, predict, prune, export); returns the list of models build_model built."""
    from tinymodels import build_tiny

    import dlenv.model.models

    built = []

    def build(name, num_classes, weights=None, **kw):
        built.append(build_tiny(name, num_classes))
        return built[-1]

    monkeypatch.setattr(dlenv.model.models, "build_model", build)
    monkeypatch.setattr(dlenv.model.models, "architecture", lambda name, n, *a, **k: build_tiny(name, n))
    # the CLI's check of a --model name before torch loads knows torchvision's names, not this stand-in's
    import dlenv.model.modelnames

    monkeypatch.setattr(dlenv.model.modelnames, "OWN_NAMES", {*dlenv.model.modelnames.OWN_NAMES, "tiny", "tiny-nonorm"})
    return built


@pytest.fixture
def wide(monkeypatch):
    """dlenv.model.models.build_model builds tinymodels.Wide, and so does models.architecture (a run file opened)."""
    from tinymodels import build_wide

    import dlenv.model.models

    monkeypatch.setattr(dlenv.model.models, "build_model", build_wide)
    monkeypatch.setattr(dlenv.model.models, "architecture", lambda name, n, *a, **k: build_wide(name, n))


@pytest.fixture
def data(tmp_path):
    """train/ and val/ of two classes, 8 and 2 images of 16 px each: what the tiny models train on."""
    from imagedata import make_train_val

    return make_train_val(tmp_path / "ds", per_class=8)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with models/{resnet,vit,named}.py (tests/usermodels.py), as the working folder, its
    modules importable for the test only. (test_projectreqs and test_slurm name a workspace of their own so.)"""
    root = write_project(tmp_path / "proj")
    monkeypatch.chdir(root)
    with isolated_imports(tmp_path):
        yield root
