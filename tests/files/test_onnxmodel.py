"""dlenv.files.onnxmodel: the description dlenv writes into an ONNX file, read back bounded; the file run by
onnxruntime as a torch module; and each file it cannot take (damaged metadata, another input size, not
ONNX at all) as one line. A tiny convnet at 32 px. And files from elsewhere, built with onnx.helper: control flow
that repeats work (a Loop of 2**62 trips), inputs and outputs of another kind, sizes out of bounds, metadata
that int() or json would choke on; each refused, or run, in one line."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dlenv import compat
from dlenv.errors import UserError
from dlenv.files import onnxmodel

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


# ---------------------------------------------------------------------------------------------------
# Files from elsewhere (issue 43, item 5): graphs built with onnx.helper, each refused or run in one line


def _graph(nodes, inputs, outputs, initializers=(), meta=None, functions=()):
    """An ONNX model of `nodes` (onnx.helper), opset 17, with string metadata `meta`."""
    from onnx import helper

    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              functions=list(functions))
    for k, v in (meta or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    return model


def _vi(name, elem="FLOAT", shape=("N", 3, SIZE, SIZE)):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, getattr(TensorProto, elem), list(shape) if shape is not None else None)


def _classifier(x="x", size=SIZE, elem="FLOAT", extra_inputs=(), meta=None, before=()):
    """x [N, 3, size, size] -> mean over H, W -> MatMul (3 x 3) -> logits [N, 3]."""
    import numpy as np
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    nodes = [*before, helper.make_node("ReduceMean", [x], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("MatMul", ["m", "w"], ["logits"])]
    return _graph(nodes, [_vi("x", elem, ("N", 3, size, size)), *extra_inputs], [_vi("logits", shape=("N", 3))],
                  [w], meta)


def _loop(trips=2**62):
    """The issue's Loop: the input carried through a body `trips` times."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Identity", ["v"], ["v_out"])], "body",
        [_vi("i", "INT64", ()), _vi("c", "BOOL", ()), _vi("v", shape=None)],
        [_vi("c_out", "BOOL", ()), _vi("v_out", shape=None)])
    return [helper.make_node("Constant", [], ["trips"], value=helper.make_tensor("t", TensorProto.INT64, [], [trips])),
            helper.make_node("Constant", [], ["go"], value=helper.make_tensor("g", TensorProto.BOOL, [], [True])),
            helper.make_node("Loop", ["trips", "go", "x0"], ["x"], body=body)]


def _if_around(nodes, out="x"):
    """`nodes` (making `out` from x0) as the taken branch of an If on a constant."""
    from onnx import TensorProto, helper

    branch = helper.make_graph(list(nodes), "branch", [], [_vi(out, shape=None)])
    other = helper.make_graph([helper.make_node("Identity", ["x0"], [out])], "other", [], [_vi(out, shape=None)])
    return [helper.make_node("Constant", [], ["yes"], value=helper.make_tensor("y", TensorProto.BOOL, [], [True])),
            helper.make_node("If", ["yes"], [out], then_branch=branch, else_branch=other)]


def _renamed_input(model):
    model.graph.input[0].name = "x0"
    return model


def _nested_ifs(depth):
    """A Loop in the taken branch of Ifs nested `depth` deep."""
    nodes = _loop()
    for _ in range(depth):
        nodes = _if_around(nodes)
    return _renamed_input(_classifier(before=nodes))


def _scan():
    from onnx import helper

    body = helper.make_graph([helper.make_node("Identity", ["s"], ["s_out"])], "body",
                             [_vi("s", shape=None)], [_vi("s_out", shape=None)])
    return [helper.make_node("Scan", ["x0"], ["x"], body=body, num_scan_inputs=0)]


def _own_op_with_a_body():
    from onnx import helper

    body = helper.make_graph([helper.make_node("Identity", ["s"], ["s_out"])], "body",
                             [_vi("s", shape=None)], [_vi("s_out", shape=None)])
    return [helper.make_node("Repeat", ["x0"], ["x"], domain="com.example", body=body)]


def _dlenv_meta(**change):
    return {**onnxmodel.metadata(NAMES, SIZE, None, "bilinear"), **change}


FOREIGN = [
    ("a Loop of 2**62 trips (hung predict for good)", lambda: _renamed_input(_classifier(before=_loop())),
     "has a Loop node, which repeats its work"),
    ("a Loop of 2**62 trips with dlenv's metadata", lambda: _renamed_input(_classifier(before=_loop(),
                                                                                       meta=_dlenv_meta())),
     "has a Loop node"),
    ("a Loop inside an If", lambda: _renamed_input(_classifier(before=_if_around(_loop()))), "has a Loop node"),
    ("a Scan", lambda: _renamed_input(_classifier(before=_scan())), "has a Scan node"),
    ("another domain's node with a body", lambda: _renamed_input(_classifier(before=_own_op_with_a_body())),
     "has a Repeat node"),
    ("a Loop in Ifs nested 30 deep", lambda: _nested_ifs(30), "has a Loop node"),
    ("a scalar output", lambda: _graph([__import__("onnx").helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)],
                                       [_vi("x")], [_vi("s", shape=())]), "gives outputs of 0 dimensions"),
    ("a sequence output", lambda: _graph([__import__("onnx").helper.make_node("SequenceConstruct", ["x"], ["s"])],
                                         [_vi("x")], [__import__("onnx").helper.make_tensor_sequence_value_info(
                                             "s", __import__("onnx").TensorProto.FLOAT, None)]),
     "gives seq(tensor(float)), not a tensor of class scores"),
    ("an int64 input", lambda: _renamed_input(_classifier(elem="INT64", before=[
        __import__("onnx").helper.make_node("Cast", ["x0"], ["x"], to=1)])), "takes tensor(int64) input"),
    ("a second input", lambda: _classifier(extra_inputs=[_vi("y")]), "takes 2 inputs (x, y)"),
    ("an input of 30000x30000", lambda: _classifier(size=30000), "takes 30000x30000 images"),
    ("an input of 8x8", lambda: _classifier(size=8), "outside the 16 to 2048 px"),
    ("img_size in other digits", lambda: _classifier(meta=_dlenv_meta(img_size="\u00b3\u00b2")), "'img_size'"),
    ("class_names nested 100,000 deep", lambda: _classifier(meta=_dlenv_meta(
        class_names="[" * 100_000 + "]" * 100_000)), "'class_names'"),
    ("mean nested 100,000 deep", lambda: _classifier(meta=_dlenv_meta(mean="[" * 100_000 + "]" * 100_000,
                                                                      std="[1, 1, 1]")), "'mean/std'"),
    ("a node onnxruntime does not know", lambda: _graph([__import__("onnx").helper.make_node(
        "NoSuchOp", ["x"], ["logits"], domain="com.example")], [_vi("x")], [_vi("logits", shape=("N", 3))]),
     "is not an ONNX model onnxruntime can load"),
    ("a graph that fails when it runs", lambda: _graph([__import__("onnx").helper.make_node(
        "Reshape", ["x", "shape"], ["logits"])], [_vi("x")], [_vi("logits", shape=("N", 3))],
        [__import__("onnx").numpy_helper.from_array(__import__("numpy").array([7, 7], dtype="int64"), "shape")]),
     "does not run on 32x32 images"),
]


@pytest.mark.parametrize("make, phrase", [f[1:] for f in FOREIGN], ids=[f[0] for f in FOREIGN])
def test_a_foreign_graph_is_refused_or_run_in_one_line(make, phrase, tmp_path, capfd):
    import onnx

    path = tmp_path / "m.onnx"
    onnx.save(make(), str(path))
    with pytest.raises(UserError, match=re.escape(phrase)) as e:
        onnxmodel.open_file(path, None)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    out, err = capfd.readouterr()
    assert "onnxruntime" not in out + err  # its own coloured log line is off: dlenv's line says it


def test_a_foreign_classifier_without_control_flow_runs(tmp_path):
    import onnx

    path = tmp_path / "m.onnx"
    onnx.save(_classifier(), str(path))
    opened = onnxmodel.open_file(path, None)
    assert opened.class_names == ("0", "1", "2") and opened.img_size == SIZE
    x = torch.rand(4, 3, SIZE, SIZE)
    assert torch.allclose(opened.module(x), x.mean((2, 3)), atol=1e-6)


def test_outputs_that_are_not_one_row_per_image_are_one_line(tmp_path):
    """A graph whose output does not follow the batch (a constant 1 x 3) passes the probe of one image and
    is stopped at the first batch of several."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    c = numpy_helper.from_array(np.ones((1, 3), dtype=np.float32), "c")
    model = _graph([helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
                    helper.make_node("Add", ["c", "m"], ["logits"])], [_vi("x")], [_vi("logits", shape=(1, 3))], [c])
    onnx.save(model, str(tmp_path / "m.onnx"))
    opened = onnxmodel.open_file(tmp_path / "m.onnx", None)
    with pytest.raises(UserError, match=r"gave float32 outputs of shape \(1, 3\) for a batch of 5 images"):
        opened.module(torch.rand(5, 3, SIZE, SIZE))
