"""Numbers a bare state dict gives (issue 34, item 5): the class count val reads from a head's shape is
bounded as a dlenv checkpoint's num_classes is (1 to 100,000, dlenv.runfolder.runstate.MAX_CLASSES), and read only
from a tensor whose every element is stored: a stride of 0 (expand) or overlapping strides give a shape
that costs no bytes. Each refusal is one line naming the file, the tensor and the bound. A key is as
long as the file's bytes allow: prefixes are stripped in time linear in it, and messages cut it short.
(A dlenv checkpoint's own entries: test_bad_inputs.py and test_runstate.py.)"""

from __future__ import annotations

import time

import pytest
import torch
from torchvision.models import resnet18

from dlenv import cli, models
from dlenv.errors import UserError
from dlenv.runfolder import runstate

#: fc.weight of a bare state dict -> the class count read from it, or the line that refuses it
HEADS = [
    ("10^10 rows, zero stride (no bytes)", lambda: torch.zeros(1, 1).expand(10**10, 512),
     "its head fc.weight (10000000000x512) gives 10,000,000,000 classes, not a class count of 1 to 100,000"),
    ("100,001 rows, stored", lambda: torch.zeros(100_001, 1), "gives 100,001 classes, not a class count of 1 to"),
    ("2^63-1 rows", lambda: torch.zeros(1, 1).expand(2**63 - 1, 1), "gives 9,223,372,036,854,775,807 classes"),
    ("no rows", lambda: torch.zeros(0, 512), "gives 0 classes, not a class count of 1 to 100,000"),
    ("10 rows, zero stride", lambda: torch.zeros(1, 512).expand(10, 512),
     "its head fc.weight (10x512) repeats stored numbers (strides (0, 1): zero or overlapping)"),
    ("10 rows, zero stride inside", lambda: torch.zeros(10, 1).expand(10, 512), "strides (1, 0): zero or"),
    ("10 rows overlapping", lambda: torch.zeros(600).as_strided((10, 512), (8, 1)), "strides (8, 1): zero or"),
    ("100,000 rows, stored", lambda: torch.zeros(100_000, 1), 100_000),
    ("1 row", lambda: torch.zeros(1, 512), 1),
    ("10 rows, transposed (strided, not overlapping)", lambda: torch.zeros(512, 10).t(), 10),
    ("10 rows, every other column (gaps)", lambda: torch.zeros(10, 1024)[:, ::2], 10),
    ("10x1, stride 0 on the size-1 dimension", lambda: torch.zeros(10).as_strided((10, 1), (1, 0)), 10),  # moot
]


@pytest.mark.parametrize("make, expect", [h[1:] for h in HEADS], ids=[h[0] for h in HEADS])
def test_the_class_count_of_a_bare_state_dict_is_bounded(make, expect):
    sd = {"layer.weight": torch.zeros(4, 4), "fc.weight": make(), "fc.bias": torch.zeros(1)}
    if isinstance(expect, int):
        assert models._num_classes_from(sd, "w.pth") == expect
        return
    with pytest.raises(UserError) as err:
        models._num_classes_from(sd, "w.pth")
    line = str(err.value)
    assert "\n" not in line and line.startswith("w.pth: its head fc.weight (") and expect in line, line
    assert "use another weights file" in line


@pytest.mark.parametrize("make, expect", [
    (lambda sd: {**sd, "fc.weight": torch.zeros(1, 1).expand(10**10, 512)}, "gives 10,000,000,000 classes"),
    (lambda sd: {**sd, "fc.weight": sd["fc.weight"][:1].expand(10, 512)}, "repeats stored numbers"),
    (lambda sd: {k: v for k, v in sd.items() if v.ndim != 2}, "cannot tell the number of classes"),
    (lambda sd: sd, None),
], ids=["10^10-classes", "zero-stride-head", "no-linear-layer", "a-real-state-dict"])
def test_a_bare_state_dict_is_rebuilt_only_within_the_bounds(make, expect):
    """model_from_state is what val --model NAME calls on a bare state dict."""
    sd = make(resnet18(num_classes=10).state_dict())
    if expect is None:
        model, names, size = models.model_from_state(sd, "resnet18", source="w.pth")
        assert names == [str(i) for i in range(10)] and model.fc.out_features == 10 and size is None
        return
    with pytest.raises(UserError, match=expect) as err:
        models.model_from_state(sd, "resnet18", source="w.pth")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_dlenv_val_refuses_a_head_beyond_the_bound_in_one_line(tmp_path, monkeypatch, capsys, suffix):
    """The issue's command, in-process through the CLI: a bare state dict whose head has 100,001 rows (a
    stored tensor: its bytes are in the file) is one line and a non-zero exit, nothing allocated for it."""
    monkeypatch.chdir(tmp_path)
    sd = {**resnet18(num_classes=2).state_dict(), "fc.weight": torch.zeros(100_001, 1), "fc.bias": torch.zeros(2)}
    runstate.save_state(sd, tmp_path / f"w{suffix}")
    (tmp_path / "ds" / "cat").mkdir(parents=True)
    code = cli.main(["val", "--weights", f"w{suffix}", "--model", "resnet18", "--data", "ds", "--device", "cpu",
                     "--workers", "0"])
    out, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlenv val: error: "), err
    assert f"w{suffix}: its head fc.weight (100001x1) gives 100,001 classes, not a class count of 1 to 100,000" \
        in lines[0]


# ---------------------------------------------------------------------------------------------------
# Keys: as long as the file's bytes allow


@pytest.mark.parametrize("key, stripped", [
    ("module." * 1_000_000 + "fc.weight", "fc.weight"),  # 7 MB of prefixes: one slice, not a copy per prefix
    ("module._orig_mod.fc.weight", "fc.weight"),
    ("_orig_mod.module.fc.weight", "module.fc.weight"),  # DDP inside compile: module. is stripped first
    ("module.module._orig_mod._orig_mod.fc.weight", "fc.weight"),
    ("fc.module.weight", "fc.module.weight"),
])
def test_prefixes_are_stripped_in_time_linear_in_the_key(key, stripped):
    start = time.perf_counter()
    assert list(runstate.strip_prefixes({key: torch.zeros(1)})) == [stripped]
    assert time.perf_counter() - start < 2.0  # the old cut-one-at-a-time loop took minutes for the first row


@pytest.mark.parametrize("key", ["x" * 1_000_000, "a\nb\x1b[2J" * 1000, "fc.weight\n" * 10])
def test_a_state_dict_that_does_not_fit_names_its_keys_in_one_short_line(key):
    sd = {**resnet18(num_classes=10).state_dict(), key: torch.zeros(1)}
    with pytest.raises(UserError, match=r"w.pth does not match architecture 'resnet18' \(0 missing, 1 unexpected") \
            as err:
        models.model_from_state(sd, "resnet18", source="w.pth")
    line = str(err.value)
    assert "\n" not in line and "\x1b" not in line and len(line) < 600, line[:200]
    model = resnet18(num_classes=10)
    with pytest.raises(UserError) as err:
        models._load_state(model, sd, "resnet18", 10, "--weights w.pth")  # train --weights
    assert "\n" not in str(err.value) and len(str(err.value)) < 600
