"""Models of one's own through the real trainer and the commands that read its run-state files (CPU).

Three architectures (tests/usermodels.py) train for an epoch with --amp --checkpoint; checkpointing is
exact on each (outputs, gradients, BatchNorm buffers, dropout masks); val, prune and export rebuild
them from the recorded factory and refuse in one line when the file is gone or not trusted; EMA,
resume, DDP (gloo), --batch-size auto and --compile work as they do for torchvision's models.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import gpushare
import pytest
import torch
import yaml
from ckptcompare import assert_same, compare_plain_and_checkpointed, train_step
from imagedata import make_train_val
from usermodels import MODELS, RESNET

from dlenv import cli, compat
from dlenv import train as train_mod
from dlenv.compress import export_main, prune_main
from dlenv.engine.precision import Precision
from dlenv.errors import UserError
from dlenv.evaluate import main as val_main
from dlenv.files import runstate
from dlenv.model import checkpointing, models, usermodel
from dlenv.options import config, values
from dlenv.options.config import ExportConfig, PruneConfig, TrainConfig, ValConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(project):
    """conftest's project (models/{resnet,vit,named}.py, the working folder) with data/{train,val} of 16 px
    images."""
    make_train_val(project / "data", per_class=8)
    return project


def train(on_step=None, **kw):
    base = dict(data="data", img_size=16, batch_size=4, workers=0, epochs=1, device="cpu", deterministic=True,
                amp=True, checkpoint=True, project="runs", model="models/resnet.py:build",
                amp_dtype="bf16", checkpoint_ratio=1.0)  # the bf16 path and every block, even where slower
    base.update(kw)
    return train_mod.train(config.build(TrainConfig, **{k: v for k, v in base.items() if v is not None}),
                           on_step=on_step)


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


# ---------------------------------------------------------------------------------------------------
# Training: one epoch of each, --amp --checkpoint


@pytest.mark.parametrize("name,model_args,img_size,args", [
    ("resnet.py", "width=4", 16, {"width": 4}),
    ("vit.py", "depth=3,drop=0.1", None, {"depth": 3, "drop": 0.1, "img_size": 16}),  # its declared size
    ("named.py", None, 16, {}),
])
def test_each_model_trains_an_epoch_with_amp_and_checkpointing(project, monkeypatch, name, model_args,
                                                                 img_size, args):
    wrapped = []
    real = checkpointing.apply_checkpointing
    monkeypatch.setattr(checkpointing, "apply_checkpointing",
                        lambda m, r=1.0: wrapped.append(real(m, r)) or wrapped[-1])
    ref = f"models/{name}:build"
    out = train(model=ref, model_args=model_args, img_size=img_size)
    assert out["exit_code"] == 0 and out["precision"] == "bf16" and out["step"] == 4
    assert wrapped == [args.get("depth", MODELS[name][1])]

    run = Path(out["run_dir"])
    text = (run / "config.yaml").read_text()
    cfg = yaml.safe_load(text)
    assert cfg["model"] == ref and cfg["img_size"] == 16 and cfg["amp"] and cfg["checkpoint"]
    assert cfg["model_args"] == (values.model_args_text(model_args) if model_args else None)
    assert f"# model_source: {{'ref': '{ref}', 'sha256': '" in text
    assert config.build(TrainConfig, run / "config.yaml").model == ref  # reusable with --cfg
    import hashlib

    sha = hashlib.sha256((project / "models" / name).read_bytes()).hexdigest()
    for f in ("last.pth", "best_model.pth"):
        ck = torch.load(run / f, map_location="cpu", weights_only=True)  # plain types only
        src = runstate.decode(ck)["model_source"]
        assert src == {"ref": ref, "sha256": sha, "args": args, "file": str(project / "models" / name)}
        assert ck["model_name"] == ref and ck["img_size"] == 16


def test_convolutional_models_only_get_channels_last(project):
    # the trainer asks models.is_convolutional (channels_last on CUDA only; see the GPU test)
    conv = {n: models.is_convolutional(usermodel.build(f"models/{n}:build", 3)) for n in MODELS}
    assert conv == {"resnet.py": True, "vit.py": False, "named.py": True}


# ---------------------------------------------------------------------------------------------------
# Exactness of checkpointing on each


def _batches(classes=3, n=2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, classes, (4,), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointing_is_exact_on_each_model(project, name, precision):
    torch.manual_seed(0)
    model = usermodel.build(f"models/{name}:build", 3)
    prec = Precision(precision, "cpu") if precision == "bf16" else None
    plain, ckpt, n = compare_plain_and_checkpointed(model, _batches(), precision=prec)
    assert n == MODELS[name][1] and n == len(checkpointing.find_blocks(model))
    # outputs, every gradient, every buffer (BatchNorm statistics, counts) and the RNG's end state
    assert_same(plain, ckpt, exact_grads=precision == "fp32")
    moved = [k for k, b in model.named_buffers() if k.endswith("num_batches_tracked")]
    assert all(int(model.get_submodule(k.rsplit(".", 1)[0]).num_batches_tracked) == 2 for k in moved)


@pytest.mark.parametrize("name,control", [
    ("resnet.py", "dropout"), ("vit.py", "dropout"), ("named.py", "dropout"),
    ("resnet.py", "batchnorm"), ("named.py", "batchnorm"),
])
def test_the_comparison_catches_new_dropout_masks_and_double_batchnorm_updates(project, monkeypatch, name,
                                                                                 control):
    """Negative controls: each model's dropout and BatchNorm are live inside its blocks."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    if control == "dropout":
        monkeypatch.setattr(checkpointing.compat, "checkpoint", lambda fn, *a: torch_checkpoint(
            fn, *a, use_reentrant=False, preserve_rng_state=False))
    else:
        monkeypatch.setattr(checkpointing, "_is_norm_with_stats", lambda m: False)
    torch.manual_seed(0)
    plain, ckpt, _ = compare_plain_and_checkpointed(usermodel.build(f"models/{name}:build", 3), _batches())
    with pytest.raises(AssertionError, match="buffer" if control == "batchnorm" else ""):
        assert_same(plain, ckpt)


# ---------------------------------------------------------------------------------------------------
# val, prune and export rebuild the model; a missing, changed or untrusted file


def _val(weights, **kw):
    return val_main(config.build(ValConfig, weights=str(weights), **{"workers": 0, "device": "cpu", **kw}))


def _prune(weights, **kw):
    return prune_main(config.build(PruneConfig, weights=str(weights), workers=0, device="cpu", batch_size=8, **kw))


def _export(weights, **kw):
    return export_main(config.build(ExportConfig, weights=str(weights), workers=0, batch_size=8,
                                    format="torchscript", **kw))


VERBS = {"val": _val, "prune": _prune, "export": _export}


@pytest.fixture
def trained(project):
    out = train(model="models/resnet.py:build", model_args="width=4", epochs=1)
    return Path(out["best"])


@pytest.mark.parametrize("verb", ["val", pytest.param("prune", marks=pytest.mark.slow), "export"])  # prune: 8 s
def test_val_prune_export_rebuild_the_model_and_refuse_without_its_file(trained, project, verb, capsys):
    assert VERBS[verb](trained) == 0
    out = capsys.readouterr().out
    assert {"val": "reports in", "prune": "_pruned.pth", "export": "torchscript"}[verb] in out
    (project / "models" / "resnet.py").rename(project / "resnet_moved.py")
    with pytest.raises(UserError, match=rf"{trained} names --model models/resnet.py:build, models/resnet.py not "
                                        r"found in the working folder .*proj; importing it would run its code, so "
                                        r"it is not imported. If you trust it, pass --model") as err:
        VERBS[verb](trained)
    one_line(err)
    # named again where it is now, it is rebuilt with the recorded arguments (width=4)
    assert VERBS[verb](trained, model="resnet_moved.py:build") == 0


@pytest.mark.parametrize("verb", ["val", "export", "resume"])
@pytest.mark.parametrize("img_size, trained_at", [(None, 16), (24, 24)], ids=["declared-16", "img-size-24"])
def test_a_factory_taking_img_size_is_rebuilt_by_every_command(project, verb, img_size, trained_at):
    """vit.py's build(num_classes, img_size=16, ...) gets --img-size (or its own default) from the trainer,
    which records it in model_source; val, export and --resume rebuild it from that record, at the size
    it was trained at (the GPU suite's vit.py case caught val refusing it: 'not a keyword argument name')."""
    ref = "models/vit.py:build"
    if verb == "resume":
        def on_step(state):
            if state.step == 1:
                signal.raise_signal(signal.SIGTERM)

        part = train(on_step=on_step, model=ref, img_size=img_size)
        assert part["exit_code"] == 143
        resumed = train(resume=part["last"])
        assert resumed["exit_code"] == 0 and resumed["step"] == 4
        weights = Path(resumed["last"])
    else:
        weights = Path(train(model=ref, img_size=img_size)["best"])
        assert VERBS[verb](weights) == 0
    ckpt = runstate.load_state(weights)
    assert ckpt["model_source"]["args"] == {"img_size": trained_at} and ckpt["img_size"] == trained_at
    model = models.model_from_state(ckpt, source=str(weights))[0]
    assert model.pos.shape[1] == (trained_at // 4) ** 2  # built to the trained size: one position a patch


@pytest.mark.parametrize("verb", ["val", pytest.param("prune", marks=pytest.mark.slow), "export"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_code_from_an_unpacked_archive_is_not_the_projects_model(trained, project, tmp_path, verb, suffix):
    """Issue 34's case: `dlenv unpack pets.zip --dest datasets/pets --keep-code` keeps net.py (without the
    flag unpack leaves code out); a weights file in the archive names it with its sha256. val, prune and
    export import it only when --model names it."""
    net = "import pathlib\npathlib.Path(__file__).with_name('RAN').touch()\n" + RESNET
    ref = "datasets/pets/net.py:build"
    ckpt = runstate.load_state(trained)
    ckpt.update(model_name=ref, config={**ckpt["config"], "model": ref},
                model_source={"ref": ref, "sha256": hashlib.sha256(net.encode()).hexdigest(), "args": {"width": 4},
                              "file": None})
    weights = runstate.save_state(ckpt, tmp_path / f"w{suffix}")
    with zipfile.ZipFile(tmp_path / "pets.zip", "w") as z:
        z.writestr("pets/train/cat/0.jpg", b"jpg")
        z.writestr("pets/net.py", net)
        z.write(weights, f"pets/w{suffix}")
    assert cli.main(["unpack", str(tmp_path / "pets.zip"), "--dest", "datasets/pets", "--no-report",
                     "--keep-code"]) == 0
    unpacked = project / "datasets" / "pets" / f"w{suffix}"
    with pytest.raises(UserError, match=r"names --model datasets/pets/net.py:build, datasets/pets/net.py, inside "
                                        r"datasets/pets/, which `dlenv unpack` wrote from an archive; importing it "
                                        r"would run its code, so it is not imported. If you trust it, pass "
                                        r"--model datasets/pets/net.py:build") as err:
        VERBS[verb](unpacked)
    one_line(err)
    assert not (project / "datasets" / "pets" / "RAN").exists()
    assert VERBS[verb](unpacked, model=ref) == 0  # vouched for: imported, the trained model rebuilt
    assert (project / "datasets" / "pets" / "RAN").exists()


def test_a_changed_file_is_refused_and_named_again_warns_in_one_line(trained, project, caplog):
    path = project / "models" / "resnet.py"
    path.write_text(path.read_text() + "\n# a comment changes the hash, not the weights\n")
    with pytest.raises(UserError, match="is not the file it was trained with"):
        _val(trained)  # not the code the run recorded: not imported unless the user names it
    with caplog.at_level(logging.WARNING, logger="dlenv.model.modelsource"):
        assert _val(trained, model="models/resnet.py:build") == 0
    assert [m for m in caplog.messages if "differs from the file this run was trained with" in m] == [
        m for m in caplog.messages if "models/resnet.py" in m] and len(caplog.messages) == 1


def test_trust_rule_for_every_command_and_resume(project, tmp_path, monkeypatch):
    """Trained with an absolute reference: read from the file, it is imported by no command, in the project
    or elsewhere, until --model names it again."""
    ref = f"{project / 'models' / 'resnet.py'}:build"

    def on_step(state):
        if state.step == 1:
            signal.raise_signal(signal.SIGTERM)

    part = train(on_step=on_step, model=ref, data=str(project / "data"), project=str(project / "runs"))
    assert part["exit_code"] == 143
    last = Path(part["last"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for verb, run in VERBS.items():
        with pytest.raises(UserError, match=r"names --model .*resnet.py:build, an absolute path; importing it "
                                            r"would run its code") as err:
            run(last)
        one_line(err)
        assert run(last, model=ref) == 0, verb
    with pytest.raises(UserError, match=r"--resume .*last.pth names --model .*, an absolute path"):
        train(resume=str(last))
    assert train(resume=str(last), model=ref)["exit_code"] == 0


# ---------------------------------------------------------------------------------------------------
# Resume, EMA, --batch-size auto, --compile, DDP: unchanged


@pytest.mark.slow
def test_resume_with_ema_is_bit_exact(project):
    opts = dict(epochs=2, batch_size=2, accum_steps=2, ema=True, model_args="width=4")  # 4 steps per epoch
    full = train(project="a", **opts)

    def on_step(state):
        if state.step == 3:
            signal.raise_signal(signal.SIGTERM)

    part = train(project="b", on_step=on_step, **opts)
    assert part["exit_code"] == 143
    resumed = train(resume=part["last"], epochs=None)  # the saved --epochs 2, not the helper's 1
    assert resumed["exit_code"] == 0 and resumed["step"] == full["step"] == 8
    a, b = runstate.load_state(full["last"]), runstate.load_state(resumed["last"])
    for key in ("model",):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])
    assert all(torch.equal(a["ema"]["module"][k], b["ema"]["module"][k]) for k in a["ema"]["module"])
    assert a["model_source"] == b["model_source"] and b["model_source"]["args"] == {"width": 4}


def test_batch_size_auto_probes_the_same_model(project, monkeypatch):
    """The probe builds the model as the run does: the factory with its arguments (a GPU measures it:
    tests/model/test_usermodel_train.py::test_gpu_...)."""
    from dlenv.engine import autobatch, stepprobe
    from dlenv.train import auto

    built = []

    def probe(factory, *a, **k):
        built.append(factory())
        return type("P", (), {"close": lambda self: None, "rate": lambda self, b: 1.0})()

    monkeypatch.setattr(stepprobe, "make_train_step_probe", probe)
    monkeypatch.setattr(autobatch, "fastest_batch", lambda rate, **k: autobatch.BatchChoice(24, "a fake card"))
    from dlenv.train.plan import ModelSpec

    cuda = type("D", (), {"type": "cuda"})()
    spec = ModelSpec("models/resnet.py:build", 3, {"width": 4}, auto.Decision(16, "--img-size 16"), None)
    n = auto.auto_batch(spec.probe("bf16", cuda, channels_last=False), 1.0, 100, print)
    assert n == 24 and built[0].fc.in_features == 8


def _aot_eager_counting(graphs):
    """torch.compile's graph capture and AOT autograd without code generation (which takes a minute per
    model on this CPU; the GPU test compiles for real), counting the graphs."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


@pytest.mark.skipif(not compat.HAS_COMPILE, reason="PyTorch 1.13 has no torch.compile")
def test_compile_captures_a_checkpointed_model_whole(project, monkeypatch):
    """--compile --checkpoint --amp: the blocks' loop and both blocks' checkpoints are traced into one
    graph, not given up on and run eagerly (validation runs the uncompiled model)."""
    graphs = []
    monkeypatch.setattr(compat, "compile_model", lambda m, **kw: torch.compile(m, backend=_aot_eager_counting(graphs)))
    out = train(model="models/vit.py:build", compile=True, max_steps=2)
    assert out["exit_code"] == 0 and len(graphs) == 1
    assert sum(name.startswith("wrap_body") for name, _ in graphs[0].named_children()) == 2


@pytest.mark.skipif(not compat.HAS_COMPILE, reason="PyTorch 1.13 has no torch.compile")
def test_checkpointing_under_compile_is_exact(project):
    """Compiled, the recompute is the compiled backward's: still the outputs, gradients, BatchNorm
    buffers and dropout masks of the plain eager model."""
    torch.manual_seed(0)
    model = usermodel.build("models/resnet.py:build", 3).train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    plain = train_step(model, _batches(n=1))
    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    assert checkpointing.apply_checkpointing(model) == 2
    graphs = []
    out, grads, buffers, rng = train_step(torch.compile(model, backend=_aot_eager_counting(graphs)), _batches(n=1))
    assert [sum(n.startswith("wrap_body") for n, _ in g.named_children()) for g in graphs] == [2]
    bare = {k.replace("_orig_mod.", ""): v for k, v in grads.items()}, {
        k.replace("_orig_mod.", ""): v for k, v in buffers.items()}
    assert_same(plain, (out, *bare, rng), exact_grads=False)


@pytest.mark.slow
def test_two_processes_train_a_model_of_ones_own(project):
    """DDP through the real launcher (torchrun, gloo on the CPU): each rank imports the file."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "dlenv", "train", "--model", "models/resnet.py:build", "--model-args", "width=4",
           "--amp", "--checkpoint", "--ema", "--data", "data", "--img-size", "16", "--batch-size", "2",
           "--epochs", "1", "--gpus", "2", "--device", "cpu", "--workers", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "x 2 GPU" in p.stdout
    ck = runstate.load_state(project / "runs" / "exp" / "last.pth")
    assert ck["world_size"] == 2 and ck["model_source"]["args"] == {"width": 4}


def test_a_bad_model_is_one_line_from_the_command_line_and_writes_nothing(project):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    (project / "models" / "broken.py").write_text("import torch\n\ndef build(num_classes):\n    return nn.Linear(2)\n")
    for ref, says in [("models/nope.py:build", "models/nope.py:build: no such file"),
                      ("models/broken.py:build",
                       "build(num_classes=2) failed at line 4 of models/broken.py: NameError")]:
        p = subprocess.run([sys.executable, "-m", "dlenv", "train", "--model", ref, "--data", "data", "--device",
                            "cpu", "--workers", "0"], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr
    assert not (project / "runs").exists()


# ---------------------------------------------------------------------------------------------------
# On the GPU: the lead's H200 run


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet.py", "vit.py"])
def test_gpu_amp_checkpoint_compile_and_auto_batch(project, name):
    with gpushare.card_of():  # --batch-size auto probes a 24 GiB card, not the one the tests beside this share
        out = train(model=f"models/{name}:build", device="cuda", img_size=32 if name == "resnet.py" else None,
                    deterministic=False, compile=compat.HAS_COMPILE, batch_size="auto", epochs=2, max_steps=4)
    assert out["exit_code"] == 0 and out["precision"] in ("bf16", "fp16")
    ck = runstate.load_state(out["last"])
    first = next(v for v in ck["model"].values() if v.ndim == 4)  # the stem's conv / the patch embedding
    assert first.is_contiguous(memory_format=torch.channels_last) == (name == "resnet.py")
    assert _val(out["best"], device="cuda") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not compat.HAS_COMPILE, reason="PyTorch 1.13 has no torch.compile")
def test_gpu_checkpointing_still_saves_memory_when_compiled(project):
    """Compiled, the checkpointed blocks' activations are recomputed by the compiled backward: the
    peak stays under the same compiled run without checkpointing. This model's full-resolution stem is
    not a repeated block and holds most of the activations, so the saving is modest: on an H200 at
    128 px, 5.27 vs 6.47 GiB (0.82x); a run that saved nothing would be ~1.0x. (ResNet-50, whose
    blocks hold the activations: 5.36 vs 10.79 GiB compiled, scripts/bench_train.py.)"""
    from dlenv.runfolder import results

    peaks = {}
    for ckpt in (False, True):
        out = train(model="models/resnet.py:build", model_args="width=64", data=None, synthetic=True,
                    img_size=128, batch_size=256, device="cuda", deterministic=False, compile=True,
                    checkpoint=ckpt, checkpoint_ratio=1, max_steps=3, project=f"runs-{ckpt}")
        peaks[ckpt] = results.read_results(Path(out["run_dir"]) / "results.csv")["mem_alloc_gib"].iloc[-1]
    assert peaks[True] < 0.9 * peaks[False], peaks

