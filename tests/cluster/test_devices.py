"""dlenv.cluster.devices: --device names, and one clear line for a device that is not there."""

from __future__ import annotations

import pytest
import torch

from dlenv.cluster.devices import resolve_device
from dlenv.errors import UserError


def test_names_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name, message", [("banana", "'banana' is not a device"),
                                           ("meta", "only cuda, cuda:N, cpu or auto"),
                                           ("cuda:99", "cuda:99")])
def test_bad_names_are_one_line(name, message):
    with pytest.raises(UserError, match=message) as e:
        resolve_device(name)
    assert "\n" not in str(e.value)


def test_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.gpu
def test_cuda_takes_the_local_rank():
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cuda:0", local_rank=5) == torch.device("cuda", 0)
    with pytest.raises(UserError, match="GPU"):
        resolve_device("cuda", local_rank=torch.cuda.device_count())
