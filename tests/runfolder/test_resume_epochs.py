"""`--resume last.pth --epochs N` sets the run's new end (dlenv.runfolder.trainstate: RESUME_CHANGES, check_new_end,
Resume.new_end; the schedule re-planned by dlenv.engine.optim.set_scheduled_lr): the learning rate from the saved
step on is that of an N-epoch run at the same step, the optimizer's state goes on, N below the epochs done is
refused in one line and N equal to them has nothing to do. N unchanged stays bit-exact
(tests/train/test_train.py's resume tests; here with --epochs given as the run's own)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from tinymodels import tiny_config

from dlenv import train as train_mod
from dlenv.errors import UserError
from dlenv.files import runstate
from dlenv.runfolder import results

# 16 images at batch 4: 4 optimizer steps an epoch


def _stopped_at(tmp_path, data, step: int, **opts) -> Path:
    """last.pth of a run stopped by SIGTERM after optimizer step `step`."""
    def on_step(state):
        if state.step == step:
            signal.raise_signal(signal.SIGTERM)

    out = train_mod.train(tiny_config(tmp_path, data, **opts), on_step=on_step)
    assert out["exit_code"] == 143
    return Path(out["run_dir"]) / "last.pth"


def _lr(run_dir: Path) -> list[float]:
    return results.read_results(Path(run_dir) / "results.csv")["lr"].tolist()


@pytest.mark.parametrize("old,new", [(2, 4), pytest.param(4, 3, marks=pytest.mark.slow)])  # a finished run made
# longer; a running one shorter
def test_a_new_end_follows_the_schedule_of_a_run_that_long_and_keeps_the_optimizer(tmp_path, data, tiny, capsys,
                                                                                      old, new):
    opts = dict(optimizer="adamw", warmup_epochs=0.5)
    reference = train_mod.train(tiny_config(tmp_path / "ref", data, epochs=new, **opts))
    if old < new:
        first = train_mod.train(tiny_config(tmp_path / "a", data, epochs=old, **opts))
        last, step = Path(first["last"]), 4 * old
    else:
        last, step = _stopped_at(tmp_path / "a", data, 6, epochs=old, **opts), 6  # in epoch 2
    capsys.readouterr()
    resumed = train_mod.train(tiny_config(tmp_path / "b", data, resume=str(last), epochs=new))
    said = capsys.readouterr().out
    assert resumed["exit_code"] == 0 and resumed["epochs"] == new and resumed["step"] == 4 * new
    assert (f"--epochs {new}: the run now ends after epoch {new} instead of {old}; from optimizer step {step} on, "
            f"the learning rate is that of a {new}-epoch run's warmup-cosine at the same step") in said
    assert not [ln for ln in said.splitlines() if "ignoring" in ln and "--epochs" in ln]
    # every epoch after the resume ends at the lr of a run started with --epochs N
    done = step // 4
    assert _lr(resumed["run_dir"])[done:] == pytest.approx(_lr(reference["run_dir"])[done:], rel=1e-12, abs=0)
    ck = runstate.load_state(Path(resumed["last"]))
    assert ck["config"]["epochs"] == new
    # AdamW's step counts went on from the saved ones: the optimizer was not started afresh
    counts = {int(torch.as_tensor(s["step"]).item()) for s in ck["optimizer"]["state"].values()}
    assert counts == {4 * new}


@pytest.mark.parametrize("stop_step,epochs,why", [
    (8, 1, "has trained 2 epochs, past that end; give --epochs 2 or more"),  # below the epochs done
    (6, 1, "is in epoch 2, past that end; give --epochs 2 or more"),        # mid-epoch 2: 1 is behind it
])
def test_an_end_behind_the_run_is_refused_in_one_line(tmp_path, data, tiny, stop_step, epochs, why):
    last = _stopped_at(tmp_path, data, stop_step, epochs=4)
    before = last.read_bytes()
    with pytest.raises(UserError) as err:
        train_mod.train(tiny_config(tmp_path, data, resume=str(last), epochs=epochs))
    assert str(err.value) == (f"--epochs {epochs}: {last} {why}, or start a new run from its weights with "
                              f"--weights {last}")
    assert last.read_bytes() == before


def test_an_end_where_the_run_is_has_nothing_to_do(tmp_path, data, tiny, capsys):
    last = _stopped_at(tmp_path, data, 8, epochs=4)  # the end of epoch 2
    files = {p.name: p.read_bytes() for p in last.parent.iterdir()}
    capsys.readouterr()
    out = train_mod.train(tiny_config(tmp_path, data, resume=str(last), epochs=2))
    assert out["exit_code"] == 0 and out["status"] == "done"
    assert capsys.readouterr().out.splitlines() == [
        f"--epochs 2: {last} has trained 2 epochs already, so there is nothing to do; give --epochs 3 or more to "
        "train on"]
    assert {p.name: p.read_bytes() for p in last.parent.iterdir()} == files


@pytest.mark.slow
def test_the_runs_own_epochs_given_again_resumes_bit_exact(tmp_path, data, tiny, capsys):
    full = train_mod.train(tiny_config(tmp_path / "a", data, epochs=3))
    last = _stopped_at(tmp_path / "b", data, 5, epochs=3)
    capsys.readouterr()
    resumed = train_mod.train(tiny_config(tmp_path / "c", data, resume=str(last), epochs=3))
    assert "--epochs 3: the run now ends" not in capsys.readouterr().out
    a, b = runstate.load_state(Path(full["last"]))["model"], runstate.load_state(Path(resumed["last"]))["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_set_scheduled_lr_puts_each_group_on_its_schedule_at_the_saved_step():
    from dlenv.engine.optim import set_scheduled_lr, warmup_cosine

    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": params[:1], "lr": 1.0}, {"params": params[1:], "lr": 0.1}])
    short = warmup_cosine(opt, 0, 10)
    for _ in range(5):
        opt.step()
        short.step()
    longer = warmup_cosine(torch.optim.SGD([{"params": params[:1], "lr": 1.0}, {"params": params[1:], "lr": 0.1}]),
                           0, 20)
    longer.load_state_dict(short.state_dict())  # what a resume does: the saved step, base rates
    longer.optimizer.load_state_dict(opt.state_dict())
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # the 10-step cosine's, as saved
    set_scheduled_lr(longer)
    expected = [0.5 * (1 + torch.cos(torch.tensor(torch.pi * 5 / 20))).item() * b for b in (1.0, 0.1)]
    assert [g["lr"] for g in longer.optimizer.param_groups] == pytest.approx(expected)
    assert longer.get_last_lr() == pytest.approx(expected)
