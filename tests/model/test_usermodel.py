"""dlenv.model.usermodel: references, model arguments, importing a user's file, the checks on what its
factory returns, provenance, and blocks a model names itself. (When code a weights file names is
imported: test_modelsource.py.)"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn
from usermodels import one_line, write

from dlenv.errors import UserError
from dlenv.model import models, modelsource, usermodel
from dlenv.model.checkpointing import apply_checkpointing, find_blocks
from dlenv.model.models import build_model
from dlenv.options import config, values
from dlenv.options.config import TrainConfig


def build_like_the_trainer(ref, num_classes=3, model_args=None, img_size=None):
    """What dlenv.train does with --model, --model-args and --img-size, in its order."""
    size = img_size or usermodel.declared_img_size(ref) or 16
    kwargs = models.factory_kwargs(ref, model_args, size)
    model = build_model(ref, num_classes, model_args=kwargs)
    usermodel.check_output(model, ref, num_classes, size)
    return model, kwargs, size


# ---------------------------------------------------------------------------------------------------
# References and --model-args


@pytest.mark.parametrize("text,target,factory,is_file", [
    ("models/net.py:build", "models/net.py", "build", True),
    ("/abs/path/net.py:Net", "/abs/path/net.py", "Net", True),
    (" mypkg.nets:make ", "mypkg.nets", "make", False),
    ("mypkg:build", "mypkg", "build", False),
])
def test_references_parse(text, target, factory, is_file):
    assert usermodel.is_reference(text)
    ref = usermodel.parse_reference(text)
    assert (ref.target, ref.factory, ref.is_file) == (target, factory, is_file)


@pytest.mark.parametrize("text,match", [
    ("models/net.py", "names a file but not the function.*models/net.py:build"),
    ("models/net.py:", "'' is not a Python name"),
    ("models/net.py:1x", "'1x' is not a Python name"),
    ("my-pkg.nets:build", "neither FILE.py:factory nor package.module:factory"),
    ("a:b:c", "neither"),
    (":build", "neither"),
])
def test_bad_references_are_one_line(text, match):
    with pytest.raises(UserError, match=match) as err:
        usermodel.parse_reference(text)
    one_line(err)


@pytest.mark.parametrize("name", ["resnet18", "vit_b_16", "resnet50_pretrained"])
def test_torchvision_names_are_not_references(name):
    assert not usermodel.is_reference(name)
    assert models.factory_kwargs(name, None, 224) == {} and usermodel.provenance(name, {}) is None
    assert usermodel.declared_img_size(name) is None


@pytest.mark.parametrize("given,expected", [
    ("width=32,drop=0.1,act=gelu", {"width": 32, "drop": 0.1, "act": "gelu"}),
    (" bias = true , norm=none, tag='32', big=1e3, neg=-2 ", {"bias": True, "norm": None, "tag": "32",
                                                              "big": 1000.0, "neg": -2}),
    ({"width": 32, "act": "gelu"}, {"width": 32, "act": "gelu"}),  # a mapping, from a YAML file
    ("", {}),
    (None, {}),
])
def test_model_args_parse_to_python_values(given, expected):
    got = values.parse_model_args(given)
    assert got == expected and [type(v) for v in got.values()] == [type(v) for v in expected.values()]
    # the canonical text (config.yaml, checkpoints) parses back to the same values
    assert values.parse_model_args(values.model_args_text(given)) == expected


@pytest.mark.parametrize("given,match", [
    ("width", "'width' is not key=value"),
    ("width=", "'width=' is not key=value"),
    ("1x=3", "'1x' is not a keyword argument name"),
    ("num_classes=3", "num_classes is not a model argument: it comes from the data"),
    ("img_size=32", "img_size is not a model argument: pass --img-size instead"),
    ("a=1,a=2", "a is given twice"),
    ({"act": "a,b"}, "cannot hold a comma"),
    ({"layers": [1, 2]}, "is not a number"),
])
def test_bad_model_args_are_one_user_error_naming_the_option(given, match):
    with pytest.raises(UserError, match=f"--model-args .*{match}") as err:
        config.build(TrainConfig, model_args=given)
    one_line(err)


def test_config_and_help_know_the_forms():
    cfg = config.build(TrainConfig, model="models/net.py:build", model_args="width = 8, tag='1'")
    assert cfg.model_args == "width=8,tag='1'" and config.build(TrainConfig).model_args is None
    from dlenv.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    assert "FILE.py:factory" in sub["train"].format_help() and "--model-args" in sub["train"].format_help()
    for verb in ("val", "prune", "export"):
        assert "FILE.py:factory" in sub[verb].format_help()


def test_model_args_for_a_torchvision_model_are_refused():
    with pytest.raises(UserError, match="--model-args is for models of your own.*resnet18 takes none") as err:
        models.factory_kwargs("resnet18", "width=3", 224)
    one_line(err)


# ---------------------------------------------------------------------------------------------------
# Importing and building


def test_the_three_models_build_and_record_where_they_came_from(project):
    for name in ("resnet", "vit", "named"):
        ref = f"models/{name}.py:build"
        model, kwargs, size = build_like_the_trainer(ref)
        assert isinstance(model, nn.Module)
        src = usermodel.provenance(ref, kwargs)
        data = (project / "models" / f"{name}.py").read_bytes()
        assert src == {"ref": ref, "sha256": hashlib.sha256(data).hexdigest(), "args": kwargs,
                       "file": str(project / "models" / f"{name}.py")}
    # the transformer's factory takes img_size: its default is the run's, and it is passed and recorded
    assert usermodel.declared_img_size("models/vit.py:build") == 16
    assert build_like_the_trainer("models/vit.py:build", img_size=32)[1] == {"img_size": 32}
    _, kwargs, _ = build_like_the_trainer("models/vit.py:build", model_args="depth=3,drop=0.0")
    assert kwargs == {"depth": 3, "drop": 0.0, "img_size": 16}


def test_sibling_and_project_imports_and_package_references(project):
    write(project, "models/parts.py", "from torch import nn\nclass Head(nn.Linear):\n    pass\n")
    write(project, "models/sib.py", """
        from torch import nn
        from parts import Head              # beside the file
        from models.parts import Head as H  # from the project folder
        def build(num_classes):
            assert Head.__name__ == H.__name__ == "Head"
            return nn.Sequential(nn.Flatten(), H(3 * 16 * 16, num_classes))
    """)
    model, _, _ = build_like_the_trainer("models/sib.py:build")
    assert type(model[1]).__name__ == "Head"
    write(project, "mypkg/__init__.py", "")
    write(project, "mypkg/nets.py", "from torch import nn\ndef make(num_classes, width=4):\n"
                                    "    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))\n")
    model, _, _ = build_like_the_trainer("mypkg.nets:make")
    src = usermodel.provenance("mypkg.nets:make", {})
    assert src["file"] == str(project / "mypkg" / "nets.py")
    assert src["sha256"] == hashlib.sha256((project / "mypkg" / "nets.py").read_bytes()).hexdigest()


def test_a_changed_file_is_imported_again_and_the_same_one_once(project):
    ref = "models/resnet.py:build"
    first = usermodel.load(usermodel.parse_reference(ref))
    assert usermodel.load(usermodel.parse_reference(ref)).factory is first.factory
    (project / "models" / "resnet.py").write_text(
        (project / "models" / "resnet.py").read_text().replace("width=8", "width=6"))
    second = usermodel.load(usermodel.parse_reference(ref))
    assert second.sha256 != first.sha256 and second.factory is not first.factory
    assert usermodel.build(ref, 3).fc.in_features == 12


_BAD = {
    "syntax.py": "from torch import nn\n\ndef build(num_classes)\n    return nn.Linear(2, num_classes)\n",
    "imports.py": "import torch\nimport no_such_package_xyz\n",
    "raises_on_import.py": "x = 1\nraise RuntimeError('set MY_DATA first')\n",
    "exits.py": "import sys\nsys.exit(3)\n",
    "nofactory.py": "from torch import nn\nclass Net(nn.Module):\n    pass\ndef make(n):\n    return Net()\n",
    "notcallable.py": "build = 3\n",
    "returns_list.py": "def build(num_classes):\n    return [num_classes]\n",
    "raises.py": "def build(num_classes, width=8):\n    if width % 2:\n"
                 "        raise ValueError('width must be even')\n",
    "wrong_shape.py": "import torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self, n):\n"
                      "        super().__init__(); self.fc = nn.Linear(3, n * 2); self.n = n\n"
                      "    def forward(self, x):\n        return self.fc(x.mean((2, 3))).view(len(x), self.n, 2)\n"
                      "def build(n):\n    return M(n)\n",
    "tuple_out.py": "from torch import nn\nclass M(nn.Module):\n    def __init__(self, n):\n"
                    "        super().__init__(); self.fc = nn.Linear(3, n)\n"
                    "    def forward(self, x):\n        y = self.fc(x.mean((2, 3)))\n        return y, y\n"
                    "def build(n):\n    return M(n)\n",
    "int_out.py": "import torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self, n):\n"
                  "        super().__init__(); self.fc = nn.Linear(3, n)\n"
                  "    def forward(self, x):\n        return self.fc(x.mean((2, 3))).argmax(1, keepdim=True)\n"
                  "def build(n):\n    return M(n)\n",
    "bad_forward.py": "from torch import nn\nclass M(nn.Module):\n    def __init__(self, n):\n"
                      "        super().__init__(); self.fc = nn.Linear(5, n)\n"
                      "    def forward(self, x):\n        return self.fc(x.flatten(1))\n"
                      "def build(n):\n    return M(n)\n",
    "tiny_img.py": "from torch import nn\ndef build(n):\n    return nn.Linear(2, n)\nbuild.img_size = 8\n",
}


@pytest.mark.parametrize("ref,args,match", [
    ("models/missing.py:build", None, r"models/missing.py not found in .*proj; paths are relative to the working"),
    ("no_such_module_abc:build", None, "no module 'no_such_module_abc'"),
    ("bad/syntax.py:build", None, r"importing bad/syntax.py failed at line 3 of bad/syntax.py: SyntaxError"),
    ("bad/imports.py:build", None, "failed at line 2 of bad/imports.py: ModuleNotFoundError: No module named "
                                   "'no_such_package_xyz'"),
    ("bad/raises_on_import.py:build", None, "failed at line 2 of .*: RuntimeError: set MY_DATA first"),
    ("bad/exits.py:build", None, "importing bad/exits.py failed at line 2 .*SystemExit: 3"),
    ("bad/nofactory.py:build", None, "bad/nofactory.py has no 'build'; it defines Net, make"),
    ("bad/notcallable.py:build", None, "build in bad/notcallable.py is a int, not a function or class"),
    ("bad/returns_list.py:build", None, r"build\(num_classes=3\) returned a list, not a torch.nn.Module"),
    ("bad/raises.py:build", "width=3", r"build\(num_classes=3, width=3\) failed at line 3 of bad/raises.py: "
                                       "ValueError: width must be even"),
    ("models/resnet.py:build", "depth=4", r"cannot call build\(num_classes=3, depth=4\): .*depth.*"
                                          r"\(build\(num_classes, width=8\)\)"),
    ("bad/wrong_shape.py:build", None, r"returned a tensor of shape \[2, 3, 2\] for 2 images of 3x16x16; .*"
                                       r"\[N, num_classes\] = \[2, 3\]"),
    ("bad/tuple_out.py:build", None, "returned a tuple for 2 images"),
    ("bad/int_out.py:build", None, r"returned a tensor of shape \[2, 1\] of torch.int64"),
    ("bad/bad_forward.py:build", None, "the model's forward failed on 2 images of 3x16x16 at line 6 of "
                                       "bad/bad_forward.py: RuntimeError"),
    ("bad/tiny_img.py:build", None, "it declares img_size 8; an image size is an integer >= 16"),
])
def test_what_goes_wrong_in_a_users_file_is_one_line(project, ref, args, match):
    for name, source in _BAD.items():
        (project / "bad").mkdir(exist_ok=True)
        (project / "bad" / name).write_text(source)
    with pytest.raises(UserError, match=match) as err:
        build_like_the_trainer(ref, model_args=args)
    assert one_line(err).startswith(f"--model {ref}")


def test_the_output_check_leaves_buffers_and_rng_as_they_were(project):
    torch.manual_seed(0)
    model = usermodel.build("models/resnet.py:build", 3)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    usermodel.check_output(model, "models/resnet.py:build", 3, 16)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, buffers[k]) for k, b in model.named_buffers())
    assert model.training


def test_declared_image_size_attribute_and_default(project):
    write(project, "m/attr.py", "from torch import nn\ndef build(n):\n    return nn.Linear(2, n)\n"
                                "build.img_size = 48\n")
    write(project, "m/param.py", "from torch import nn\ndef build(n, img_size=40):\n    return nn.Linear(2, n)\n")
    write(project, "m/required.py", "from torch import nn\ndef build(n, img_size):\n    return nn.Linear(2, n)\n")
    assert usermodel.declared_img_size("m/attr.py:build") == 48
    assert models.factory_kwargs("m/attr.py:build", None, 48) == {}  # no parameter: nothing passed
    assert usermodel.declared_img_size("m/param.py:build") == 40
    assert usermodel.declared_img_size("m/required.py:build") is None
    assert models.factory_kwargs("m/required.py:build", "", 64) == {"img_size": 64}


def test_weights_start_a_users_model_from_a_file(project, tmp_path):
    src = usermodel.build("models/resnet.py:build", 3)
    torch.save(src.state_dict(), tmp_path / "w.pth")
    model = build_model("models/resnet.py:build", 3, weights=tmp_path / "w.pth")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values(),
                                                 strict=True))
    with pytest.raises(UserError, match="does not fit models/resnet.py:build"):
        build_model("models/resnet.py:build", 3, weights=tmp_path / "w.pth", width=4)


# ---------------------------------------------------------------------------------------------------
# Factory keyword arguments


@pytest.mark.parametrize("kwarg", ["name", "weights", "num_classes_", "what", "given", "source"])
def test_factory_keyword_arguments_of_any_name_reach_the_factory(project, kwarg):
    write(project, "models/kw.py", f"""
        import torch.nn as nn
        def build(num_classes, {kwarg}="default"):
            m = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))
            m.got = {kwarg}
            return m
        """)
    ref = "models/kw.py:build"
    assert usermodel.build(ref, 3, **{kwarg: "given"}).got == "given"
    assert build_model(ref, 3, weights=None, model_args={kwarg: "given"}).got == "given"  # as the trainer calls it
    assert build_like_the_trainer(ref, model_args=f"{kwarg}=typed", img_size=16)[0].got == "typed"
    source = {"ref": ref, "sha256": usermodel.file_sha256(project / "models" / "kw.py"), "args": {kwarg: "saved"}}
    assert modelsource.rebuild(source, ref, 3, None, "ck").got == "saved"


# ---------------------------------------------------------------------------------------------------
# Blocks: found in models of one's own, or named by the model


class _Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


class _Attrs(nn.Module):
    """Repeated blocks as attributes, not in a container; a wrapper class used once around them."""

    def __init__(self, declare=None):
        super().__init__()
        self.a, self.b = _Unit(), _Unit()
        self.wrap = nn.Sequential(_Unit())
        self.head = nn.Linear(4, 2)
        if declare is not None:
            self.checkpoint_blocks = declare

    def forward(self, x):
        return self.head(self.wrap(self.b(self.a(x))))


def test_repeated_classes_are_found_anywhere_in_the_model():
    model = _Attrs()
    assert find_blocks(model) == [model.a, model.b, model.wrap[0]]


@pytest.mark.parametrize("declare,expected", [
    (["b", "a"], ["b", "a"]),
    (["wrap.0"], ["wrap.0"]),
    ("head", ["head"]),
    ([], []),  # the model opts out
    (["a", "a"], ["a"]),
])
def test_checkpoint_blocks_names_the_blocks(declare, expected):
    model = _Attrs(declare)
    assert find_blocks(model) == [model.get_submodule(n) for n in expected]
    assert apply_checkpointing(model) == len(expected)


def test_checkpoint_blocks_as_modules_or_a_module_list():
    model = _Attrs()
    model.checkpoint_blocks = [model.b]  # a plain list is no registered submodule: state dict unchanged
    keys = list(model.state_dict())
    assert find_blocks(model) == [model.b] and list(model.state_dict()) == keys
    model.checkpoint_blocks = nn.ModuleList([model.a, model.b])
    assert find_blocks(model) == [model.a, model.b]


@pytest.mark.parametrize("declare,match", [
    (["c"], "_Attrs.checkpoint_blocks names 'c', which the model does not have"),
    ([3], "_Attrs.checkpoint_blocks holds a int; list modules or their names"),
    (["wrap", "wrap.0"], "lists a _Unit inside a listed Sequential; list each block once"),
])
def test_bad_checkpoint_blocks_are_one_line(declare, match):
    with pytest.raises(UserError, match=match) as err:
        find_blocks(_Attrs(declare))
    one_line(err)
