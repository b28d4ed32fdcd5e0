"""dlenv.options.config: options declared once, defaults < YAML < flags, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from dlenv.errors import UserError
from dlenv.options import config
from dlenv.options import declare as options


def test_defaults_and_flags_parse_strings():
    cfg = config.build(config.TrainConfig, batch_size="64", amp="true", lr="0.05", workers="0")
    assert cfg.batch_size == 64 and cfg.amp is True and cfg.lr == 0.05 and cfg.workers == 0
    assert cfg.epochs == config.TrainConfig().epochs


def test_auto_values():
    cfg = config.build(config.TrainConfig, batch_size="auto", workers="auto")
    assert cfg.batch_size == "auto" and cfg.workers == "auto"


def test_config_is_frozen():
    cfg = config.build(config.TrainConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3


def test_yaml_layer_between_defaults_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("epochs: 3\nbatch-size: 8\namp: true\n")
    cfg = config.build(config.TrainConfig, y, batch_size=16)
    assert cfg.epochs == 3          # from YAML
    assert cfg.batch_size == 16     # flag beats YAML
    assert cfg.amp is True


def test_unknown_key_lists_valid_ones(tmp_path):
    with pytest.raises(UserError, match="unknown option 'batchsize'.*batch-size"):
        config.build(config.TrainConfig, batchsize=3)
    y = tmp_path / "c.yaml"
    y.write_text("lrate: 0.1\n")
    with pytest.raises(UserError, match="unknown option 'lrate'"):
        config.build(config.TrainConfig, y)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": "0"}, "--batch-size '0'"),
    ({"batch_size": "many"}, "--batch-size 'many'"),
    ({"optimizer": "adam"}, "--optimizer 'adam' is not one of: auto, sgd, adamw"),
    ({"val_split": "1.5"}, "--val-split '1.5' is above its maximum"),
    ({"epochs": "2.5"}, "--epochs '2.5': expected an integer"),
    ({"amp": "maybe"}, "--amp 'maybe': expected true or false"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(UserError) as e:
        config.build(config.TrainConfig, **kwargs)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_is_one_line(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("epochs: [1,\n")
    with pytest.raises(UserError, match="not valid YAML"):
        config.build(config.TrainConfig, y)
    with pytest.raises(UserError, match="not found"):
        config.build(config.TrainConfig, tmp_path / "missing.yaml")


def test_round_trip_through_dict():
    cfg = config.build(config.BenchDataConfig, workers="0,4")
    d = config.to_dict(cfg)
    assert d["workers"] == [0, 4]
    assert config.from_dict(config.BenchDataConfig, {**d, "gone_option": 1}) == cfg


def test_every_option_has_help_and_a_parser():
    for cmd in config.COMMANDS.values():
        for f in config.options(cmd.config):
            assert f.metadata["help"], f"{cmd.name} --{f.name} has no help"
            assert callable(f.metadata["parse"])
            # every default survives its own parser (so defaults are valid values)
            if f.default is not None:
                assert f.metadata["parse"](f.default) == f.default


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lr": "nan"}, "--lr 'nan': expected a finite number"),
    ({"lr": "inf"}, "--lr 'inf': expected a finite number"),
    ({"lr": float("-inf")}, "--lr -inf: expected a finite number"),
    ({"lr": "1e400"}, "--lr '1e400': expected a finite number"),
    ({"weight_decay": "NaN"}, "--weight-decay 'NaN'"),
    ({"momentum": "nan"}, "--momentum 'nan'"),  # nan passes every min/max comparison
    ({"epochs": "inf"}, "--epochs 'inf': expected an integer"),
    ({"epochs": "1e400"}, "--epochs '1e400': expected an integer"),
    ({"epochs": float("nan")}, "--epochs nan: expected an integer"),
    ({"data": ["a", "b"]}, "--data ['a', 'b']: expected a single value"),
    ({"data": "a\0b"}, "a NUL character is not allowed"),
    ({"name": ""}, "--name '': expected a plain folder name"),
    ({"name": "a/b"}, "--name 'a/b': expected a plain folder name"),
    ({"name": ".."}, "--name '..'"),
])
def test_non_finite_and_wrongly_typed_values_are_refused(kwargs, message):
    with pytest.raises(UserError) as e:
        config.build(config.TrainConfig, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("content", "message"), [
    ("name: caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 9)"),
    (b"\x80\x02PK binary", "is not UTF-8 text (byte 0x80 at offset 0)"),
    (b"- lr\n- 0.1\n", "must hold a mapping of option: value, not a list"),
    (b"just a sentence", "must hold a mapping of option: value, not a str"),
    (b"lr: !!python/object/apply:os.system ['true']\n", "is not valid YAML"),
    (b"lr: .nan\n", "--lr nan: expected a finite number; see --help (set in config file"),
    (b"epochs: [1, 2]\n", "--epochs [1, 2]: expected an integer; see --help (set in config file"),
    (b"nme: x\n", "unknown option 'nme' in config file"),
    (b"[" * 5000, "line 1: values nested more than 32 deep"),  # refused where it starts, not at recursion's end
    (b"model_args:\n" + b"".join(b"  " * i + b"k%d:\n" % i for i in range(1, 33)) + b"  " * 33 + b"v\n",
     "line 32: values nested more than 32 deep"),  # a mapping of mappings: block style is counted too
    # values PyYAML's own constructors raise ValueError on, and keys given twice (issue 43)
    (b"seed: 2001-02-30\n", "line 1: 'seed': YAML cannot read '2001-02-30' ('day is out of range for month')"),
    (b"lr: 0.1\nseed: 0000-01-01\n", "line 2: 'seed': YAML cannot read '0000-01-01'"),
    (b"seed: 2001-13-01 10:00:00\n", "'seed': YAML cannot read '2001-13-01 10:00:00'"),
    (b"seed: " + b"9" * 5000 + b"\n", "'seed': YAML cannot read '99999"),
    (b"model_args: {depth: 2001-02-30}\n", "'depth': YAML cannot read '2001-02-30'"),
    (b"model_args: [2001-02-30]\n", "'model_args': YAML cannot read a value in it"),
    (b"2001-02-30\n", "a value YAML cannot read ('day is out of range for month')"),
    (b"epochs: 3\nlr: 0.1\nepochs: 4\n", "line 3: 'epochs' is given twice (first on line 1)"),
    (b"epochs: 3\nepochs: 3\n", "line 2: 'epochs' is given twice"),  # the same value twice is still a slip
    (b"model_args: {depth: 1, depth: 2}\n", "'depth' is given twice"),
    (b"batch-size: 3\nbatch_size: 4\n", "gives 'batch-size' twice ('batch-size', 'batch_size')"),
    (b"? [a, b]\n: 1\n", "a key that is a list, not an option name"),
])
def test_a_cfg_file_that_is_not_a_yaml_mapping_is_one_line(tmp_path, content, message):
    y = tmp_path / "c.yaml"
    y.write_bytes(content)
    with pytest.raises(UserError) as e:
        config.build(config.TrainConfig, y)
    assert message in str(e.value) and str(y) in str(e.value) and "\n" not in str(e.value)


def test_values_nested_within_the_bound_are_read(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model_args: " + "[" * 30 + "1" + "]" * 30 + "\n")  # the file, the mapping and 30 lists: 32
    with pytest.raises(UserError) as e:  # read, then refused as a --model-args value, not for its depth
        config.build(config.TrainConfig, y)
    assert "nested more than" not in str(e.value) and "--model-args" in str(e.value)


EPOCHS_REFUSED = [  # (command, option, value): every count of epochs is bounded (issue 43: 10^20 was taken)
    ("train", "epochs", str(config.EPOCHS_MAX + 1)),
    ("train", "epochs", "100000000000000000000"),
    ("train", "epochs", 10**20),  # as YAML gives it
    ("train", "freeze_epochs", str(10**9)),
    ("train", "warmup_epochs", "1e12"),
    ("prune", "finetune_epochs", str(10**6)),
]


@pytest.mark.parametrize(("command", "option", "value"), EPOCHS_REFUSED)
def test_counts_of_epochs_are_bounded(command, option, value):
    with pytest.raises(UserError) as e:
        config.build(config.COMMANDS[command].config, **{option: value})
    assert f"--{option.replace('_', '-')}" in str(e.value) and "above its maximum 100,000" in str(e.value)
    assert "\n" not in str(e.value)
    assert getattr(config.build(config.COMMANDS[command].config, **{option: config.EPOCHS_MAX}), option) == \
        config.EPOCHS_MAX


def test_a_cfg_folder_is_one_line(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        config.build(config.TrainConfig, tmp_path)


@pytest.mark.parametrize("name", [n for n, c in config.COMMANDS.items()
                                  if any(f.name == "workers" and f.type != "tuple"
                                         for f in dataclasses.fields(c.config))])
def test_every_workers_option_takes_0_auto_and_refuses_negatives(name):
    cls = config.COMMANDS[name].config
    assert config.build(cls, workers="0").workers == 0  # 0: the work runs in the main process
    assert config.build(cls, workers="auto").workers == "auto"
    assert config.build(cls, workers="3").workers == 3
    with pytest.raises(UserError, match="integer >= 0"):
        config.build(cls, workers="-1")


# ---------------------------------------------------------------------------------------------------
# Numbers and names that used to pass into the run (issue 25 items 6 and 7).

SEEDS_REFUSED = [
    ("2**64", str(2**64), "above its maximum"),
    ("2**63", str(2**63), "above its maximum"),
    ("a-hundred-digits", "9" * 99, "above its maximum"),
    ("a-thousand-digits", "9" * 1000, "expected an integer"),
    ("1e30", "1e30", "above its maximum"),
    ("1e400", "1e400", "expected an integer"),
    ("negative", "-1", "below its minimum"),
    ("negative-huge", str(-(2**70)), "below its minimum"),
    ("float", "1.5", "expected an integer"),
    ("hex", "0x10", "expected an integer"),
    ("yaml-int", 2**80, "above its maximum"),
]


@pytest.mark.parametrize(("value", "expect"), [c[1:] for c in SEEDS_REFUSED], ids=[c[0] for c in SEEDS_REFUSED])
@pytest.mark.parametrize("cls", [config.TrainConfig, config.DemoDataConfig])
def test_a_seed_beyond_64_bits_is_one_line(cls, value, expect):
    with pytest.raises(UserError) as e:
        config.build(cls, seed=value)
    assert "--seed" in str(e.value) and expect in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["0", "42", str(2**32), str(2**63 - 1), 2**63 - 1, " 7 ", "+3"])
def test_seeds_up_to_64_bits_are_kept_exactly(value):
    assert config.build(config.TrainConfig, seed=value).seed == int(str(value).strip())


def test_the_largest_seed_reaches_every_generator():
    """seed + rank, as the trainer seeds torch, NumPy and the sampler: all take it."""
    torch = pytest.importorskip("torch")
    import numpy as np

    seed = config.build(config.TrainConfig, seed=str(config.SEED_MAX)).seed
    torch.manual_seed(seed + 7)
    torch.Generator().manual_seed(seed + 7)
    np.random.default_rng([seed, 7])
    np.random.seed((seed + 7) % 2**32)


NAMES_REFUSED = [
    ("newline", "exp\nINFO: all good"),
    ("carriage-return", "exp\rfake"),
    ("escape", "exp\x1b[2J"),
    ("osc", "\x1b]0;title\x07"),
    ("tab", "a\tb"),
    ("nul", "a\x00b"),
    ("del", "a\x7fb"),
    ("c1-nel", "a\x85b"),
    ("bidi-override", "exp\u202egnp.exe"),
    ("bidi-isolate", "exp\u2066x"),
    ("line-separator", "a\u2028b"),
    ("paragraph-separator", "a\u2029b"),
    ("zero-width-space-format", "a\u200bb"),
    ("lone-surrogate", "a\udcffb"),
    ("slash", "a/b"),
    ("dot-dot", ".."),
    ("blank", "   "),
]


@pytest.mark.parametrize("name", [n for _, n in NAMES_REFUSED], ids=[i for i, _ in NAMES_REFUSED])
def test_a_run_name_that_would_act_on_a_terminal_is_refused(name, capsys):
    with pytest.raises(UserError) as e:
        config.build(config.TrainConfig, name=name)
    assert "--name" in str(e.value) and "\n" not in str(e.value)
    from dlenv import cli

    assert cli.main(["train", "--name", name, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dlenv train: error: --name") and "Traceback" not in err
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f or c in "\u202e\u2066\u2028\u2029"
                   for c in err), ascii(err)


@pytest.mark.parametrize("name", ["exp", "exp-2", "resnet50_amp", "café", "实验一", "run.v2", "a b", "🐱"])
def test_plain_run_names_are_kept(name):
    assert config.build(config.TrainConfig, name=name).name == name


# ---------------------------------------------------------------------------------------------------
# Bounds on --workers, --batch-size and --img-size (issue 34 item 8 and the weak items).


def _commands_with(option: str) -> list[str]:
    return [n for n, c in config.COMMANDS.items() if any(f.name == option for f in dataclasses.fields(c.config))]


@pytest.mark.parametrize(("cpus", "most"), [(1, 64), (2, 64), (16, 64), (17, 68), (64, 256)])
@pytest.mark.parametrize("name", _commands_with("workers"))
def test_workers_at_most_4_per_cpu_or_64(monkeypatch, name, cpus, most):
    monkeypatch.setattr(options, "usable_cpus", lambda: cpus)
    cls = config.COMMANDS[name].config
    as_typed = (lambda n: f"0,{n}") if name == "bench-data" else str  # bench-data takes a list of counts
    assert config.build(cls, workers=as_typed(most)).workers in (most, (0, most))
    with pytest.raises(UserError) as e:
        config.build(cls, workers=as_typed(most + 1))
    assert f"is above {most:,}, the most worker processes dlenv starts here ({4} x the {cpus} CPU" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_saved_runs_workers_are_not_judged_by_this_machine(monkeypatch):
    monkeypatch.setattr(options, "usable_cpus", lambda: 2)
    saved = config.to_dict(config.build(config.TrainConfig, workers=60))
    assert config.from_dict(config.TrainConfig, {**saved, "workers": 500}).workers == 500  # made on 128 CPUs
    with pytest.raises(UserError, match="--workers 500 is above 64"):
        config.build(config.TrainConfig, workers=500)  # typed here: this machine's bound


def test_bench_data_workers_refuse_a_negative_count():
    with pytest.raises(UserError, match="--workers '0,-2' is below its minimum 0"):
        config.build(config.BenchDataConfig, workers="0,-2")


BATCHES = [(name, "batch_size") for name in _commands_with("batch_size")] + [
    ("train", "accum_steps"), ("train", "effective_batch")]


@pytest.mark.parametrize(("name", "option"), BATCHES, ids=[f"{n} {o}" for n, o in BATCHES])
@pytest.mark.parametrize("value", [str(2**20 + 1), "1e12", 10**12, "1000000000000"])
def test_batch_sizes_at_most_2_to_the_20(name, option, value):
    cls = config.COMMANDS[name].config
    assert getattr(config.build(cls, **{option: str(2**20)}), option) == 2**20
    with pytest.raises(UserError) as e:
        config.build(cls, **{option: value})
    assert f"{config.flag(option)} {value!r} is above its maximum 1,048,576 (2^20" in str(e.value)


IMG_SIZES = [(name, "img_size") for name in _commands_with("img_size")] + [("demo-data", "size")]


@pytest.mark.parametrize(("name", "option"), IMG_SIZES, ids=[f"{n} {o}" for n, o in IMG_SIZES])
@pytest.mark.parametrize("value", ["2049", "1000000", 10**6, "1e9"])
def test_image_sizes_at_most_2048(name, option, value):
    cls = config.COMMANDS[name].config
    assert getattr(config.build(cls, **{option: "2048"}), option) == 2048
    with pytest.raises(UserError) as e:
        config.build(cls, **{option: value})
    assert f"{config.flag(option)} {value!r} is above its maximum 2,048 (the largest image size" in str(e.value)


def test_the_img_size_bound_is_the_one_checkpoints_have():
    from dlenv.files import runstate

    assert config.IMG_SIZE_MAX == runstate.MAX_IMG_SIZE


def test_the_class_count_bound_is_the_one_checkpoints_have():
    from dlenv.files import runstate
    from dlenv.options import declare

    assert declare.CLASSES_MAX == runstate.MAX_CLASSES


# ---------------------------------------------------------------------------------------------------
# A run's config.yaml given to another command (issue 34: val --cfg runs/x/config.yaml).


@pytest.fixture
def run_yaml(tmp_path):
    """A run's config.yaml as train writes it: every option of train, resolved."""
    import yaml

    cfg = config.build(config.TrainConfig, data="ds", weights="start.pth", model="resnet18", batch_size=48,
                       workers=3, device="cpu", img_size=64, val_split=0.3, amp=True)
    path = tmp_path / "config.yaml"
    path.write_text("# dlenv train: the options of this run\n" + yaml.safe_dump(config.to_dict(cfg), sort_keys=False))
    return path


FROM_RUN = [  # command -> what it takes from the run's file (everything else stays at its default)
    ("val", {"batch_size": 48, "workers": 3, "device": "cpu"}),
    ("prune", {"batch_size": 48, "workers": 3, "device": "cpu"}),
    ("export", {"batch_size": 48, "workers": 3}),
    ("data-report", {"val_split": 0.3, "workers": 3}),
    ("verify-env", {"workers": 3}),
    ("plot", {}),
    ("bench-memory", {"model": "resnet18", "batch_size": 48, "img_size": 64, "device": "cpu"}),
    ("bench-data", {"data": "ds", "model": "resnet18", "batch_size": 48, "img_size": 64, "device": "cpu"}),
]


@pytest.mark.parametrize(("name", "taken"), FROM_RUN, ids=[n for n, _ in FROM_RUN])
def test_a_runs_config_yaml_gives_other_commands_what_means_the_same(run_yaml, capsys, name, taken):
    cls = config.COMMANDS[name].config
    cfg = config.build(cls, run_yaml)
    default = cls()
    for f in dataclasses.fields(cls):
        assert getattr(cfg, f.name) == taken.get(f.name, getattr(default, f.name)), f.name
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and f"holds a training run's options: dlenv {name} " in out[0]
    kept = config._FROM_RUN.get(cls, ())
    assert set(taken) <= set(kept) and all(config.flag(n) in out[0] for n in kept)
    assert f"the other {len(config.to_dict(config.TrainConfig())) - len(kept)} out" in out[0]


def test_val_never_takes_trains_weights_data_or_model(run_yaml, capsys):
    cfg = config.build(config.ValConfig, run_yaml)
    assert (cfg.weights, cfg.data, cfg.model) == (None, None, None)  # start.pth is not the run's checkpoint
    out = capsys.readouterr().out
    assert "dlenv val takes " in out and all(f in out for f in ("--batch-size", "--workers", "--device"))
    assert not any(f in out for f in ("--weights", "--data", "--model"))
    assert config.build(config.ValConfig, run_yaml, weights="runs/x/best_model.pth").weights == "runs/x/best_model.pth"


@pytest.mark.parametrize(("extra", "bad"), [("lrate: 0.1\n", "lrate"), ("batchsize: 8\n", "batchsize"),
                                            ("42: x\n", "42")])
@pytest.mark.parametrize("name", ["val", "prune", "train"])
def test_a_key_no_command_has_still_fails_with_the_valid_ones(run_yaml, name, extra, bad):
    run_yaml.write_text(run_yaml.read_text() + extra)
    with pytest.raises(UserError) as e:
        config.build(config.COMMANDS[name].config, run_yaml)
    assert f"unknown option {bad!r} in config file" in str(e.value) and "valid options: " in str(e.value)


def test_a_file_of_vals_own_options_is_taken_whole_and_quietly(tmp_path, capsys):
    y = tmp_path / "val.yaml"
    y.write_text("weights: runs/x/best_model.pth\ndata: other\nbatch-size: 8\n")
    cfg = config.build(config.ValConfig, y)
    assert (cfg.weights, cfg.data, cfg.batch_size) == ("runs/x/best_model.pth", "other", 8)
    assert capsys.readouterr().out == ""


def test_what_other_commands_take_from_a_run_are_options_of_both():
    train = {f.name for f in dataclasses.fields(config.TrainConfig)}
    for cls, names in config._FROM_RUN.items():
        assert set(names) <= train & {f.name for f in dataclasses.fields(cls)}, cls


@pytest.mark.parametrize("name", ["val", "prune", "export"])
def test_a_runs_config_yaml_in_its_run_folder_names_the_runs_best_model(run_yaml, capsys, name):
    """`dlenv val --cfg runs/x/config.yaml` validates run x: its best_model.pth, not train's start file;
    a --weights given still wins, and a config.yaml with no best_model.pth beside it names none."""
    cls = config.COMMANDS[name].config
    assert config.build(cls, run_yaml).weights is None
    (run_yaml.parent / "best_model.pth").write_bytes(b"")
    capsys.readouterr()
    assert config.build(cls, run_yaml).weights == str(run_yaml.parent / "best_model.pth")
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and f"--weights is the run's {run_yaml.parent / 'best_model.pth'}" in out
    assert config.build(cls, run_yaml, weights="other.pth").weights == "other.pth"
