"""Shared test setup: marker handling and tiny datasets.

- `gpu` tests run only where CUDA is available; `image` tests only inside the built image
  (DLENV_IMAGE=1, set by the Dockerfile); `tests/container` runs only with `--image NAME`.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest
from imagedata import make_image_folder

# The project key that signs the checkpoints dlenv writes (dlenv.weights): one per test session, in a
# temporary folder, so no test writes .dlenv/key into the checkout; subprocesses inherit it.
_KEY_DIR = tempfile.mkdtemp(prefix="dlenv-key-")
os.environ["DLENV_KEY_FILE"] = os.path.join(_KEY_DIR, "key")
atexit.register(shutil.rmtree, _KEY_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _consent_to_the_tests_own_pickles(monkeypatch):
    """Tests write .pth files with torch.save to stand for files from other tools; they consent to
    unpickling them, as a user passes --trust-pickle (in-process only: subprocesses see the real gate).
    tests/test_weights.py switches the consent off to test the gate itself. Also forget how a previous
    test started dlenv (dlenv.invocation keeps it in the environment)."""
    try:
        from dlenv import weights
    except ImportError:  # tests/container on a host without the package
        return
    monkeypatch.setattr(weights, "_trust", True)
    monkeypatch.setenv("DLENV_COMMAND", "")


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


@pytest.fixture
def image_folder(tmp_path):
    """A train/ + val/ dataset of two classes with a few tiny images each."""
    make_image_folder(tmp_path / "ds" / "train", per_class=6)
    make_image_folder(tmp_path / "ds" / "val", per_class=3, seed=1)
    return tmp_path / "ds"
