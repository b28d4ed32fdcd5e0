"""dlenv.onnxmodel: the description dlenv writes into an ONNX file, read back bounded; the file run by
onnxruntime as a torch module; and each file it cannot take (damaged metadata, another input size, not
ONNX at all) as one line. A tiny convnet at 32 px."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlenv import compat, onnxmodel
from dlenv.errors import UserError

NO_ONNX = compat.onnx_export_unavailable()
pytestmark = pytest.mark.skipif(NO_ONNX is not None, reason=str(NO_ONNX))
SIZE = 32
NAMES = ["cat", "dog", "fox"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, len(NAMES))

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _export(path, meta: dict | None = None, edit=None):
    torch.manual_seed(0)
    model = Net().eval()
    compat.onnx_export(model, torch.randn(1, 3, SIZE, SIZE), path, opset=17)
    if meta is not None:
        onnxmodel.write_metadata(path, meta)
    if edit is not None:
        import onnx

        proto = onnx.load(str(path))
        edit(proto)
        onnx.save(proto, str(path))
    return model


def test_the_description_round_trips_and_the_file_runs_like_pytorch(tmp_path):
    path = tmp_path / "m.onnx"
    norm = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    model = _export(path, onnxmodel.metadata(NAMES, SIZE, norm, "bicubic"))
    opened = onnxmodel.open_file(path, None)
    assert opened.class_names == tuple(NAMES) and opened.named and opened.img_size == SIZE
    assert opened.norm == norm and opened.interpolation == "bicubic"
    x = torch.randn(5, 3, SIZE, SIZE)  # another batch size than traced: the batch axis is dynamic
    with torch.no_grad():
        assert torch.allclose(opened.module(x), model(x), atol=1e-5)
    assert opened.module(x).dtype == torch.float32


def test_a_file_without_dlenv_metadata_gets_numbered_classes_and_its_input_size(tmp_path):
    path = tmp_path / "other.onnx"
    _export(path)
    opened = onnxmodel.open_file(path, None)
    assert opened.class_names == ("0", "1", "2") and not opened.named and opened.img_size == SIZE
    assert opened.norm is None and opened.interpolation == "bilinear"


def _free_size(proto):
    for i, name in ((2, "height"), (3, "width")):
        proto.graph.input[0].type.tensor_type.shape.dim[i].dim_param = name


def test_a_file_of_any_input_size_takes_img_size(tmp_path):
    path = tmp_path / "free.onnx"
    _export(path, edit=_free_size)
    assert onnxmodel.open_file(path, 48).img_size == 48
    with pytest.raises(UserError, match="takes images of any size .* pass --img-size"):
        onnxmodel.open_file(path, None)


def _meta(**change):
    meta = onnxmodel.metadata(NAMES, SIZE, None, "bilinear")
    meta.update(change)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize("case,meta,img_size,phrase", [
    ("another --img-size", _meta(), 48, "takes 32x32 images"),
    ("metadata size other than the input's", _meta(img_size="64"), None, "metadata says 64 px but its input"),
    ("class names not a list", _meta(class_names='"cat"'), None, "'class_names'"),
    ("class names empty", _meta(class_names="[]"), None, "'class_names'"),
    ("a class name not text", _meta(class_names="[1, 2, 3]"), None, "'class_names'"),
    ("class count other than the outputs", _meta(class_names='["a", "b"]'), None, "lists 2 class names but"),
    ("size not a number", _meta(img_size="big"), None, "'img_size'"),
    ("size out of bounds", _meta(img_size="99999"), None, "'img_size'"),
    ("unknown resampling", _meta(interpolation="lanczos5"), None, "'interpolation'"),
    ("mean of two numbers", _meta(mean="[0.5, 0.5]", std="[1, 1, 1]"), None, "'mean/std'"),
    ("std of zero", _meta(mean="[0, 0, 0]", std="[1, 0, 1]"), None, "'mean/std'"),
    ("std without mean", _meta(std="[1, 1, 1]"), None, "'mean/std'"),
])
def test_a_file_it_cannot_take_is_one_line(case, meta, img_size, phrase, tmp_path):
    path = tmp_path / "m.onnx"
    _export(path, meta)
    with pytest.raises(UserError, match=phrase) as e:
        onnxmodel.open_file(path, img_size)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case,phrase", [
    ("not onnx", "is not an ONNX model onnxruntime can load"),
    ("empty", "is not an ONNX model onnxruntime can load"),
    ("a folder", "is a folder"),
    ("missing", "not found"),
])
def test_what_is_not_an_onnx_file_is_one_line(case, phrase, tmp_path):
    path = tmp_path / "m.onnx"
    if case == "not onnx":
        path.write_bytes(b"\x08\x07 not a model")
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "a folder":
        path.mkdir()
    with pytest.raises(UserError, match=phrase) as e:
        onnxmodel.open_file(path, None)
    assert "\n" not in str(e.value)
