"""dlenv.files.onnxchild: a graph from elsewhere runs in a child process with limits. Crafted graphs, each a few
KB built with onnx.helper, that crash onnxruntime (a function that calls itself), hang it (2,000 chained MatMuls,
functions doubling 60 deep, Ifs nested 30 deep) or ask it for any memory (Expand to 40,000², Resize x1000) each end
in one line from the child that names the file and the limit, within that limit (small ones here, through
DLENV_ONNX_LIMITS), exit 2 and no traceback through the CLI; a file that names another file for its data is refused
before onnxruntime sees it. And the parent: a SIGTERM or SIGINT while the child is busy ends `dlenv predict` within
2 s with the child gone, and a parent killed outright takes the child with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dlenv.errors import UserError
from dlenv.files import onnxchild, onnxmodel

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

SIZE = 32
#: the limits of these tests: a request may take 2 s (+ 0.5 s an image), 1 GiB of address space
LIMITS = "seconds=2,per_image=0.5,memory_gib=1"
#: what a request may take beyond its wall-clock limit: the interpreter's start (under a loaded CI), the kill
SLACK = 6.0
LOCAL = "local"


def _vi(name, shape=("N", 3, SIZE, SIZE)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inits=(), functions=(), meta=None):
    """A classifier's frame: input x [N, 3, 32, 32]; `nodes` make `y` (any float tensor) from x; the logits
    are x's channel means plus y's mean, [N, 3]."""
    tail = [helper.make_node("ReduceMean", ["y"], ["ym"], keepdims=0),
            helper.make_node("ReduceMean", ["x"], ["xm"], axes=[2, 3], keepdims=0),
            helper.make_node("Add", ["xm", "ym"], ["logits"])]
    graph = helper.make_graph([*nodes, *tail], "g", [_vi("x")], [_vi("logits", ("N", 3))], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(LOCAL, 1)],
                              functions=list(functions))
    model.ir_version = 8
    for k, v in (meta or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    return model


def _function(name, nodes, inputs=("a",), outputs=("b",)):
    return helper.make_function(LOCAL, name, list(inputs), list(outputs), list(nodes),
                                [helper.make_opsetid("", 17), helper.make_opsetid(LOCAL, 1)])


def _call(name, inputs, outputs):
    return helper.make_node(name, list(inputs), list(outputs), domain=LOCAL)


def _self_calling():
    return _model([_call("F", ["x"], ["y"])], functions=[_function("F", [_call("F", ["a"], ["b"])])])


def _cycle(names):
    """Functions that call each other in a ring: names[0] -> names[1] -> ... -> names[0]."""
    fs = [_function(n, [_call(names[(i + 1) % len(names)], ["a"], ["b"])]) for i, n in enumerate(names)]
    return _model([_call(names[0], ["x"], ["y"])], functions=fs)


def _doubling(depth, calls=2):
    """f0 = Relu; f_i calls f_{i-1} `calls` times in a row: inlined, calls**depth nodes."""
    fs = [_function("f0", [helper.make_node("Relu", ["a"], ["b"])])]
    for i in range(1, depth + 1):
        names = ["a", *(f"t{j}" for j in range(1, calls)), "b"]
        fs.append(_function(f"f{i}", [_call(f"f{i - 1}", [names[j]], [names[j + 1]]) for j in range(calls)]))
    return _model([_call(f"f{depth}", ["x"], ["y"])], functions=fs)


def _nested_ifs(depth):
    """Ifs nested `depth` deep, each branch the next If (the innermost: x's Relu)."""
    cond = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True]))
    inner = [helper.make_node("Relu", ["x"], ["y"])]
    for i in range(depth):
        then = helper.make_graph(inner, f"then{i}", [], [_vi("y", None)])
        other = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], f"else{i}", [], [_vi("y", None)])
        inner = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    return _model([cond, *inner])


def _const(name, values, dtype="int64"):
    return numpy_helper.from_array(np.array(values, dtype=dtype), name)


def _matmul_chain(n, side=2048):
    """x's mean Expand-ed to side x side, then `n` MatMuls of it with itself."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
             helper.make_node("Expand", ["m", "shape"], ["t0"])]
    nodes += [helper.make_node("MatMul", [f"t{i}", f"t{i}"], [f"t{i + 1}"]) for i in range(n)]
    nodes.append(helper.make_node("Identity", [f"t{n}"], ["y"]))
    return _model(nodes, [_const("shape", [side, side])])


def _expand(*shape):
    """x's mean Expand-ed to `shape`."""
    return _model([helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
                   helper.make_node("Expand", ["m", "shape"], ["y"])], [_const("shape", list(shape))])


def _resize(factor):
    return _model([helper.make_node("Resize", ["x", "", "scales"], ["y"])],
                  [_const("scales", [1, 1, factor, factor], "float32")])


def _tile(times):
    return _model([helper.make_node("Tile", ["x", "reps"], ["y"])], [_const("reps", [1, 1, times, times])])


def _constant_of_shape(side):
    return _model([helper.make_node("ConstantOfShape", ["shape"], ["y"])], [_const("shape", [side, side])])


def _external(location, where="initializer"):
    t = _const("w", [1.0, 2.0, 3.0], "float32")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "12")):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
    if where == "initializer":
        return _model([helper.make_node("Add", ["x", "w"], ["y"])], [t])
    return _model([helper.make_node("Constant", [], ["w"], value=t), helper.make_node("Add", ["x", "w"], ["y"])])


#: (what, the graph, the line's words). Each runs through onnxmodel.open_file: loading and the probe of one image.
CRAFTED = [
    ("a function that calls itself (SIGSEGV in-process)", _self_calling, r"crashed|limit"),
    ("F calls G calls F", lambda: _cycle(["F", "G"]), r"crashed|limit"),
    ("F calls G calls H calls F", lambda: _cycle(["F", "G", "H"]), r"crashed|limit"),
    ("functions calling the previous twice, 60 deep", lambda: _doubling(60), r"limit|crashed"),
    ("functions calling the previous three times, 40 deep", lambda: _doubling(40, 3), r"limit|crashed"),
    ("If nested 30 deep", lambda: _nested_ifs(30), r"limit|crashed"),
    ("2,000 chained MatMuls on 2048x2048 from the input", lambda: _matmul_chain(2000), r"wall-clock limit"),
    ("200 chained MatMuls on 4096x4096", lambda: _matmul_chain(200, 4096), r"wall-clock limit|memory limit"),
    ("Expand to 40,000² floats", lambda: _expand(40_000, 40_000), r"memory limit"),
    ("Expand to 3 x 100,000 x 100,000", lambda: _expand(1, 3, 100_000, 100_000), r"memory limit"),
    ("Resize x1000", lambda: _resize(1000), r"memory limit"),
    ("Tile x20,000", lambda: _tile(20_000), r"memory limit"),
    ("ConstantOfShape 40,000²", lambda: _constant_of_shape(40_000), r"memory limit"),
]


@pytest.fixture
def small_limits(monkeypatch):
    monkeypatch.setenv(onnxchild.ENV, LIMITS)


def _children_of(pid):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _gone(pid, within=3.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("make, words", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_a_crafted_graph_ends_in_one_line_from_the_child_within_its_limit(make, words, small_limits, tmp_path):
    path = tmp_path / "crafted.onnx"
    onnx.save(make(), str(path))
    assert path.stat().st_size < 200_000  # tiny files
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        onnxmodel.open_file(path, None)
    took = time.monotonic() - t0
    line = str(e.value)
    assert "\n" not in line and str(path) in line and re.search(words, line), line
    assert isinstance(e.value, onnxchild.ChildFailed) and e.value.exit_code == 2
    assert took < 2 * (2 + 0.5) + SLACK, took  # loading and the probe, each within its limit


@pytest.mark.parametrize("location, where", [("../../../etc/passwd", "initializer"), ("/etc/shadow", "initializer"),
                                             ("../../../etc/passwd", "Constant node")])
def test_data_in_another_file_is_refused_before_onnxruntime(location, where, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_external(location, where), str(path))
    with pytest.raises(UserError, match=re.escape(f"keeps its tensor 'w' in another file ('{location}')")):
        onnxmodel.open_file(path, None)


def test_a_graph_past_its_cpu_time_limit_is_one_line(monkeypatch, tmp_path):
    """The CPU-time limit stands on its own: with a wall-clock limit of 60 s, a CPU-time limit of 1 s ends the
    MatMul chain by SIGXCPU."""
    monkeypatch.setenv(onnxchild.ENV, "seconds=60")
    monkeypatch.setattr(onnxchild.Limits, "cpu", lambda self, wall, threads: 1.0)
    path = tmp_path / "m.onnx"
    onnx.save(_matmul_chain(2000), str(path))
    t0 = time.monotonic()
    with pytest.raises(onnxchild.ChildFailed, match=r"m\.onnx: onnxruntime ran past its CPU-time limit of 1 s"):
        onnxmodel.open_file(path, None)
    assert time.monotonic() - t0 < 1 + SLACK


def test_a_good_graph_runs_batches_in_one_child_and_close_ends_it(small_limits, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])], meta=onnxmodel.metadata(["a", "b", "c"], SIZE, None,
                                                                                       "bilinear")), str(path))
    opened = onnxmodel.open_file(path, None)
    child = opened.module.session.proc
    import torch

    for n in (1, 5, 64):
        x = torch.rand(n, 3, SIZE, SIZE)
        expected = x.mean((2, 3)) + torch.relu(x).mean()
        assert torch.allclose(opened.module(x), expected, atol=1e-5)
    assert opened.module.session.proc is child and child.poll() is None  # one child for every batch
    opened.module.close()
    assert child.poll() is not None


@pytest.mark.parametrize("value", ["seconds=0", "seconds=abc", "minutes=3", "memory_gib=-1", "seconds"])
def test_bad_limits_in_the_environment_are_one_line(value, monkeypatch):
    monkeypatch.setenv(onnxchild.ENV, value)
    with pytest.raises(UserError, match=re.escape(onnxchild.ENV)):
        onnxchild.Limits.from_env()


def test_the_limits_scale_with_the_batch():
    limits = onnxchild.Limits()
    wall1, mem1 = limits.batch(1, 224, 0)
    wall64, mem64 = limits.batch(64, 224, 0)
    assert wall64 - limits.seconds == pytest.approx(64 * (wall1 - limits.seconds))
    assert mem64 > mem1 and limits.batch(1, 448, 0)[0] - limits.seconds == pytest.approx(4 * limits.per_image)


def test_the_child_imports_neither_torch_nor_the_working_folder(tmp_path):
    """`python -m dlenv.files.onnxchild` as Child starts it, from a folder holding a numpy.py and a dlenv/ of
    its own: neither is imported, and torch is not loaded."""
    (tmp_path / "numpy.py").write_text("raise SystemExit('the working folder was imported')\n")
    (tmp_path / "dlenv").mkdir()
    (tmp_path / "dlenv" / "__init__.py").write_text("raise SystemExit('the working folder was imported')\n")
    code = ("import sys, runpy; sys.argv[1:] = ['0']; import dlenv.files.onnxchild as m; "
            "print('torch' in sys.modules, m.np.__file__)")
    from dlenv.invocation import _RUN_MODULE

    out = subprocess.run([sys.executable, "-c", _RUN_MODULE.replace("runpy.run_module(sys.argv.pop(1), "
                          "run_name='__main__', alter_sys=True)", code)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    torch_loaded, numpy_file = out.stdout.split()
    assert torch_loaded == "False" and not numpy_file.startswith(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# Through the CLI: one line and exit 2; a stop signal ends the parent and the child.


def _image(folder):
    from PIL import Image

    Image.new("RGB", (40, 40), (120, 30, 200)).save(folder / "img.png")
    return folder / "img.png"


def _predict(tmp_path, model, env_limits):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    env = {**os.environ, onnxchild.ENV: env_limits}
    return subprocess.Popen([sys.executable, "-m", "dlenv", "predict", "--weights", str(path), "--source",
                             str(_image(tmp_path)), "--device", "cpu"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_self_calling, lambda: _expand(40_000, 40_000), lambda: _matmul_chain(2000)],
                         ids=["calls itself", "Expand 40,000²", "MatMul chain"])
def test_predict_says_one_line_and_exits_2(make, tmp_path):
    proc = _predict(tmp_path, make(), LIMITS)
    out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "m.onnx" in lines[0] and "limit" in lines[0]


def _busy_child(proc, within=60.0):
    """The pid of `proc`'s onnxruntime child, once it has been at work for a second."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        for pid in _children_of(proc.pid):
            try:
                if b"dlenv.files.onnxchild" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    time.sleep(1.0)
                    return pid
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError("no onnxruntime child started")


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_ends_predict_and_its_child_within_2_s(sig, code, tmp_path):
    proc = _predict(tmp_path, _matmul_chain(2000), "seconds=600")
    child = _busy_child(proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    took = time.monotonic() - t0
    assert took < 2.0 and proc.returncode == code, (took, proc.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _gone(child), "the child outlived predict"


@pytest.mark.slow
def test_a_parent_killed_outright_takes_the_child_with_it(tmp_path):
    proc = _predict(tmp_path, _matmul_chain(2000), "seconds=600")
    child = _busy_child(proc)
    proc.kill()
    proc.communicate(timeout=10)
    assert _gone(child), "the child outlived its parent (PR_SET_PDEATHSIG)"


@pytest.mark.parametrize("body, words", [
    ("raise RuntimeError('module compiled against ABI version 0x2000000 but this version of numpy is 0x1000009')",
     "onnxruntime is installed but fails to import (RuntimeError: module compiled against ABI"),
    ("raise AttributeError('_ARRAY_API not found')", "onnxruntime is installed but fails to import (AttributeError"),
])
def test_an_onnxruntime_that_fails_to_import_in_the_child_is_one_line_and_pip_check(body, words, tmp_path,
                                                                                   monkeypatch):
    (tmp_path / "fake" / "onnxruntime").mkdir(parents=True)
    (tmp_path / "fake" / "onnxruntime" / "__init__.py").write_text(body + "\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "m.onnx"
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])]), str(path))
    with pytest.raises(UserError, match=re.escape(words)) as e:
        onnxmodel.open_file(path, None)
    assert "pip check" in str(e.value) and "\n" not in str(e.value)


def test_a_memory_limit_too_small_to_start_onnxruntime_points_at_the_limit(monkeypatch, tmp_path):
    """memory_gib=0.000001 leaves the child no room to import onnxruntime: the line names the limit and how to raise
    it, not pip check (the import did not fail for a broken install)."""
    monkeypatch.setenv(onnxchild.ENV, "memory_gib=0.000001")
    path = tmp_path / "m.onnx"
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])]), str(path))
    with pytest.raises(onnxchild.ChildFailed) as e:
        onnxmodel.open_file(path, None)
    assert "ran out of its" in str(e.value) and onnxchild.ENV in str(e.value) and "pip check" not in str(e.value)
