"""dlenv.config: options declared once, defaults < YAML < flags, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from dlenv import config
from dlenv.errors import UserError


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
    (b"[" * 5000, "config file"),  # deeply nested: YAML's own limit or ours, one line either way
])
def test_a_cfg_file_that_is_not_a_yaml_mapping_is_one_line(tmp_path, content, message):
    y = tmp_path / "c.yaml"
    y.write_bytes(content)
    with pytest.raises(UserError) as e:
        config.build(config.TrainConfig, y)
    assert message in str(e.value) and str(y) in str(e.value) and "\n" not in str(e.value)


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
