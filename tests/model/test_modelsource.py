"""dlenv.model.modelsource: code a weights file names is imported only when the user named it (--model) or it
is the project's own model, as recorded; the factory arguments a file gives are bounded. Each attack
places a model file whose import would leave a marker, and asserts the marker is not there.
(The commands val, prune and export: tests/files/test_weights.py and tests/test_bad_inputs.py.)"""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile

import pytest
from usermodels import one_line, write

from dlenv.data.unpack import MARKER, unpack
from dlenv.errors import UserError
from dlenv.model import modelsource


def _source(ref, path=None, args=None):
    sha = hashlib.sha256(path.read_bytes()).hexdigest() if path else None
    return {"ref": ref, "sha256": sha, "args": args or {}, "file": str(path) if path else None}


#: a model file whose import leaves a marker: the proof that a file's code ran
EVIL = """
import pathlib
pathlib.Path(__file__).with_name("RAN").touch()
def build(n):
    raise SystemExit("the attacker's factory ran")
"""


def _place(project, tmp_path, where):
    """Put EVIL where the case says; returns (reference text, the marker its import would leave)."""
    if where == "absolute":
        path = write(tmp_path, "outside/evil.py", EVIL)
        return f"{path}:build", path.with_name("RAN")
    if where == "dotdot":
        path = write(tmp_path, "outside/evil.py", EVIL)
        return "../outside/evil.py:build", path.with_name("RAN")
    if where == "symlink out":
        path = write(tmp_path, "outside/evil.py", EVIL)
        (project / "linked").symlink_to(path.parent)
        return "linked/evil.py:build", path.with_name("RAN")
    if where == "data/":  # what `unpack` wrote from an archive
        path = write(project, "data/pets/evil.py", EVIL)
        return "data/pets/evil.py:build", path.with_name("RAN")
    if where == "tilde":
        return "~/evil.py:build", tmp_path / "never"
    if where == "module outside":
        return "json:dumps", tmp_path / "never"
    if where == "module under data/":
        write(project, "data/__init__.py", "")
        path = write(project, "data/evil.py", EVIL)
        return "data.evil:build", path.with_name("RAN")
    if where.startswith("unpacked"):  # `dlenv unpack pets.zip --dest datasets/pets`: anywhere but data/
        dest = project / "datasets" / "pets"
        rel = "code/deep/evil.py" if where == "unpacked, deep inside" else "evil.py"
        members = {"pets/train/cat/0.jpg": b"jpg", f"pets/{rel}": EVIL.encode(), "pets/__init__.py": b""}
        zipped = tmp_path / "pets.zip"
        with zipfile.ZipFile(zipped, "w") as z:
            for name, data in members.items():
                z.writestr(name, data)
        unpack(zipped, dest, progress=False, keep_code=True)  # the marker rule: code a user kept
        marker = dest / rel.replace("evil.py", "RAN")
        if where == "unpacked, run from inside it":
            os.chdir(dest)
            return "evil.py:build", marker
        if where == "unpacked, reached by a symlink":
            (project / "models" / "extra").symlink_to(dest)
            return "models/extra/evil.py:build", marker
        if where == "unpacked module":
            write(project, "datasets/__init__.py", "")
            return "datasets.pets.evil:build", marker
        return f"datasets/pets/{rel}:build", marker
    raise AssertionError(where)


@pytest.mark.parametrize("where, why", [
    ("absolute", "an absolute path"),
    ("dotdot", "climbs out of the working folder with '..'"),
    ("symlink out", "which leads outside the working folder"),
    ("data/", "under data/ where unpacked archives go"),
    ("tilde", "an absolute path"),
    ("module outside", "a module not found in the working folder"),
    ("module under data/", "under data/ where unpacked archives go"),
    ("unpacked --dest datasets/pets", "evil.py, inside datasets/pets/, which `dlenv unpack` wrote from an archive"),
    ("unpacked, deep inside", "code/deep/evil.py, inside datasets/pets/, which `dlenv unpack` wrote"),
    ("unpacked, run from inside it", "which `dlenv unpack` wrote from an archive"),
    ("unpacked, reached by a symlink", "datasets/pets/evil.py, inside datasets/pets/, which `dlenv unpack` wrote"),
    ("unpacked module", "datasets/pets/__init__.py, inside datasets/pets/, which `dlenv unpack` wrote"),
])
@pytest.mark.parametrize("with_sha", [True, False], ids=["with-sha", "without-sha"])
def test_a_reference_read_from_a_file_is_refused_before_anything_is_imported(project, tmp_path, where, why,
                                                                            with_sha):
    ref, marker = _place(project, tmp_path, where)
    target = ref.rpartition(":")[0]
    real = (project / target).resolve() if target.endswith(".py") and not target.startswith("~") else None
    source = _source(ref, real if with_sha and real and real.is_file() else None)
    for check in (lambda: modelsource.check_source(source, None, "w.pth"),
                  lambda: modelsource.rebuild(source, ref, 3, None, "w.pth"),
                  lambda: modelsource.rebuild(None, ref, 3, None, "w.pth"),  # no model_source at all
                  lambda: modelsource.check_resume({"model_source": source, "config": {"model": ref}}, None,
                                                   "--resume w")):
        with pytest.raises(UserError) as err:
            check()
        line = one_line(err)
        assert line.startswith("w.pth names --model") or line.startswith("--resume w names --model"), line
        assert "it is not imported" in line and f"pass --model {ref}" in line
        assert why in line or "no model_source" in line, line
    assert not marker.exists(), "the file's code ran"


@pytest.mark.parametrize("case", ["project file beside it", "named with --model", "the same file, not unpacked"])
def test_an_unpacked_folder_refuses_only_its_own_code(project, tmp_path, case):
    """Controls for the unpacked cases above: the rule is the marker unpack wrote, it reaches only the
    folder unpack made, and --model still vouches for a file in it."""
    ref, ran = _place(project, tmp_path, "unpacked --dest datasets/pets")
    evil = ran.with_name("evil.py")
    if case == "project file beside it":
        path = project / "models" / "resnet.py"
        assert modelsource.check_source(_source("models/resnet.py:build", path), None, "w.pth").text == \
            "models/resnet.py:build"
        return
    if case == "the same file, not unpacked":  # copied by hand: no marker, the project's own by the rule
        copy = write(project, "datasets/mine/evil.py", EVIL)
        assert not list(copy.parent.glob(MARKER))
        assert modelsource.check_source(_source("datasets/mine/evil.py:build", copy), None, "w.pth")
        return
    assert not ran.exists()
    assert modelsource.check_source(_source(ref, evil), ref, "w.pth").text == ref  # the user's choice: used
    assert ran.exists()  # named with --model, it was imported


@pytest.mark.parametrize("case, why", [
    ("same file", None),
    ("no sha", "without the sha256 of the file it was trained with"),
    ("changed", r"is not the file it was trained with \(sha256"),
    ("missing", "models/resnet.py not found in the working folder"),
    ("package", None),
    ("package changed", "is not the file it was trained with"),
])
def test_the_model_this_project_trained_with_is_rebuilt_from_the_file_alone(project, case, why):
    path = project / "models" / "resnet.py"
    ref, source = "models/resnet.py:build", _source("models/resnet.py:build", path)
    if case.startswith("package"):
        write(project, "mypkg/__init__.py", "")
        pkg = write(project, "mypkg/nets.py", "def make(n):\n    pass\n")
        ref, source = "mypkg.nets:make", _source("mypkg.nets:make", pkg)
        if case == "package changed":
            pkg.write_text(pkg.read_text() + "# tuned\n")
    elif case == "no sha":
        source["sha256"] = None
    elif case == "changed":
        path.write_text(path.read_text() + "\n# tuned\n")
    elif case == "missing":
        path.unlink()
    if why is None:
        assert modelsource.check_source(source, None, "w.pth").text == ref
        return
    with pytest.raises(UserError, match=why) as err:
        modelsource.check_source(source, None, "w.pth")
    assert f"If you trust it, pass --model {ref}" in one_line(err)


def test_named_again_with_model_it_is_the_users_choice(project, tmp_path, caplog):
    inside = project / "models" / "resnet.py"
    absolute = f"{inside}:build"
    assert modelsource.check_source(_source(absolute, inside), absolute, "ck").path() == inside
    # a resume names the saved reference again in another spelling of the same file
    saved = {"model_source": _source(absolute, inside), "config": {"model": absolute}}
    modelsource.check_resume(saved, "models/resnet.py:build", "--resume x")
    with pytest.raises(UserError, match="an absolute path"):
        modelsource.check_resume(saved, "models/vit.py:build", "--resume x")
    inside.write_text(inside.read_text() + "\n# tuned\n")  # changed, and named: built as it is, with a warning
    with caplog.at_level(logging.WARNING, logger="dlenv.model.modelsource"):
        modelsource.check_source(_source("models/resnet.py:build", tmp_path / "proj" / "models" / "vit.py"),
                               "models/resnet.py:build", "ck")
    assert "differs from the file this run was trained with" in caplog.messages[0]


@pytest.mark.parametrize("source, match", [
    ({"ref": 3}, "'model_source' entry is malformed"),
    ("models/resnet.py:build", "'model_source' entry is malformed"),
    ({"ref": "m.py:b", "args": [1]}, "'model_source' entry is malformed"),
    ({"ref": "m.py:" + "b" * 300}, "'model_source' entry is malformed"),
    ({"ref": "m.py:b", "args": {"width": 10**9}}, r"gives width=1000000000, beyond the bounds .*65536"),
    ({"ref": "m.py:b", "args": {"drop": 1e300}}, r"gives drop=1e\+300, beyond the bounds"),
    ({"ref": "m.py:b", "args": {"drop": float("nan")}}, "gives drop=nan, beyond the bounds"),
    ({"ref": "m.py:b", "args": {"act": "x" * 1000}}, "beyond the bounds .*256 characters"),
    ({"ref": "m.py:b", "args": {f"a{i}": 1 for i in range(40)}}, "40 factory arguments, more than 32"),
    ({"ref": "m.py:b", "args": {"num_classes": 3}}, "names the factory argument 'num_classes'"),
    ({"ref": "m.py:b", "args": {"not a name": 3}}, "names the factory argument 'not a name'"),
    # img_size is the trainer's own record for a factory that takes it, bounded as an image size
    ({"ref": "m.py:b", "args": {"img_size": 100000}}, r"gives img_size=100000, not an image size of 16 to 2048"),
    ({"ref": "m.py:b", "args": {"img_size": 8}}, r"gives img_size=8, not an image size"),
    ({"ref": "m.py:b", "args": {"img_size": "32"}}, r"gives img_size='32', not an image size"),
    ({"ref": "m.py:b", "args": {"img_size": True}}, r"gives img_size=True, not an image size"),
    ({"ref": "m.py:b", "args": {"img_size": 32.0}}, r"gives img_size=32.0, not an image size"),
])
def test_what_a_file_says_about_the_factory_is_bounded(project, source, match):
    with pytest.raises(UserError, match=match) as err:
        modelsource.check_source(source, None, "ck")
    one_line(err)


@pytest.mark.parametrize("args", [{"img_size": 16}, {"img_size": 2048, "depth": 3}, {"depth": 1, "drop": 0.5},
                                  {"img_size": 224, "patch_size": 16, "class_token": True, "act_layer": "gelu"}])
def test_every_keyword_a_trainer_records_is_read_back(project, args):
    """The arguments a run records (--model-args and the img_size dlenv gives a factory that takes one)
    are what a file's record is read back as: val, prune, export and --resume build the trained model."""
    path = project / "models" / "vit.py"
    ref, saved_args = modelsource.read_source(_source("models/vit.py:build", path, args), "ck")[::2]
    assert (ref, saved_args) == ("models/vit.py:build", args)
    assert modelsource.check_source(_source("models/vit.py:build", path, args), None, "ck").text == ref


@pytest.mark.parametrize("given", [None, "models/resnet.py:build"])
def test_a_resume_checks_the_model_its_saved_options_build(project, tmp_path, given):
    """model_source names the project's own file (it passes), the saved options another one: a resume
    builds the options' model, so that is the one checked."""
    evil = write(tmp_path, "outside/evil.py", EVIL)
    ckpt = {"model_name": "models/resnet.py:build", "config": {"model": f"{evil}:build"},
            "model_source": _source("models/resnet.py:build", project / "models" / "resnet.py")}
    with pytest.raises(UserError, match=rf"would build --model {evil}:build, but records where "
                                        r"models/resnet.py:build came from") as err:
        modelsource.check_resume(ckpt, given, "--resume last.pth")
    assert f"pass --model {evil}:build yourself" in one_line(err)
    assert not evil.with_name("RAN").exists()
    modelsource.check_resume({**ckpt, "config": {"model": "models/resnet.py:build"}}, given, "--resume last.pth")
    modelsource.check_resume({**ckpt, "config": {"model": "resnet18"}}, None, "--resume last.pth")  # no code
