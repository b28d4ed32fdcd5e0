"""dlenv.cluster.distributed on a CPU: real 2-process gloo runs of the collectives and of the trainer.

Multi-process scenarios run tests/_distributed_worker.py once per rank with the environment torchrun
would set, so each check is a real process group (a few seconds each on a small machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dlenv.cluster import distributed, launch
from dlenv.errors import UserError

TESTS = Path(__file__).resolve().parents[1]
WORKER = TESTS / "_distributed_worker.py"


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


def start_ranks(scenario: str, args: dict, world: int = 2) -> list[subprocess.Popen]:
    port = launch.free_port()
    return [subprocess.Popen([sys.executable, str(WORKER), scenario, json.dumps(args)], env=_env(r, world, port),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, dict | None, str]]:
    """(exit status, RESULT json or None, stderr) of each rank; kills what is still running at the end."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            out.append((p.returncode, json.loads(lines[-1][7:]) if lines else None, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


# ---------------------------------------------------------------------------------------------------
# Real process groups.


@pytest.fixture(scope="module")
def collectives() -> list[dict]:
    """Both ranks' results of the reduction and no_sync checks (one 2-process gloo group)."""
    runs = finish(start_ranks("collectives", {"n": 7, "micro": 2, "accum": 2}))
    assert [rc for rc, _, _ in runs] == [0, 0], [e[-2000:] for _, _, e in runs]
    return [r for _, r, _ in runs]


def test_metrics_reduced_over_uneven_shards_count_each_sample_once(collectives):
    n = 7  # 4 + 3: a padding sampler would count 8
    shards = [r["reduce"]["shard"] for r in collectives]
    assert sorted(shards[0] + shards[1]) == list(range(n))
    for r in collectives:
        assert r["reduce"]["sums"] == {"loss": float(sum(range(n))), "correct": 3.0, "count": 7.0}
    assert [r["reduce"]["main"] for r in collectives] == [True, False]


def test_no_sync_accumulation_gives_full_batch_gradients(collectives):
    for r in (c["nosync"] for c in collectives):
        assert r["weights_from_rank0"], "DDP must start every rank from rank 0's weights"
        assert r["first_is_local"], "the non-final micro-batch must not all-reduce"
        assert r["max_grad_diff"] < 1e-6, r


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_dead_or_stuck_rank_stops_the_others_with_a_message(how):
    timeout = 4
    procs = start_ranks("dies", {"how": how, "timeout": timeout})
    rc0, r0, err0 = finish(procs[:1], timeout=240)[0]  # a safety net: the whole case takes seconds
    finish(procs[1:], timeout=1) if how == "exit" else None
    for p in procs[1:]:  # the stuck rank is ours to end
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc0 == launch.EXIT_PEER, err0
    assert "rank 0: all_reduce failed: another process of this run stopped" in err0
    # the run's timeout, not the process group's default of 30 minutes (the margin is for a loaded box)
    assert r0["seconds"] < timeout + 60, "rank 0 must not wait much past the timeout"


# ---------------------------------------------------------------------------------------------------
# The real trainer on 2 CPU processes.


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.slow
def test_two_processes_train_like_one_with_the_same_effective_batch(tmp_path):
    """2 ranks x micro-batch 2 x accumulation 2 against 1 process x batch 8: the ranks' shards of each
    step are the single process's batch, gradients are averaged, so weights and metrics match."""
    from imagedata import make_train_val

    from dlenv.runfolder import results

    make_train_val(tmp_path / "ds", per_class=8, val_per_class=4)
    (tmp_path / "ds" / "val" / "dog" / "dog_3.png").unlink()  # 7 val images: shards of 4 and 3
    base = dict(data=str(tmp_path / "ds"), img_size=16, workers=0, epochs=2, device="cpu", deterministic=True,
                model="tiny", label_smoothing=0.0, warmup_epochs=0.0, lr=0.5, seed=3)
    one = dict(base, project=str(tmp_path / "one"), batch_size=8)
    two = dict(base, project=str(tmp_path / "two"), batch_size=2, accum_steps=2, gpus=2)
    single = subprocess.Popen([sys.executable, str(WORKER), "train", json.dumps(one)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**_env(0, 1, 0), "WORLD_SIZE": "1"})
    runs = finish(start_ranks("train", two), timeout=120)  # side by side with the single process
    (rc1, r1, err1), = finish([single], timeout=120)
    assert rc1 == 0, err1
    assert [rc for rc, _, _ in runs] == [0, 0], [e[-1500:] for _, _, e in runs]

    # only rank 0 wrote, and the same files as one process
    assert _tree(tmp_path / "two") == _tree(tmp_path / "one")
    assert runs[1][1]["summary"]["run_dir"] is None and runs[1][1]["summary"]["last"] is None
    a = results.read_results(Path(r1["summary"]["run_dir"]) / "results.csv")
    b = results.read_results(Path(runs[0][1]["summary"]["run_dir"]) / "results.csv")
    for col in ("train_loss", "val_loss", "top1", "top5"):
        assert b[col].tolist() == pytest.approx(a[col].tolist(), abs=1e-4), col
    assert a["train_loss"].iloc[-1] < a["train_loss"].iloc[0], "the run must learn something"

    ck1 = torch.load(Path(r1["summary"]["last"]), map_location="cpu", weights_only=True)
    ck2 = torch.load(Path(runs[0][1]["summary"]["last"]), map_location="cpu", weights_only=True)
    for k, v in ck1["model"].items():
        assert torch.allclose(ck2["model"][k], v, atol=1e-5), k
    assert ck2["world_size"] == 2 and ck2["config"]["batch_size"] == 2 and ck2["config"]["accum_steps"] == 2


def test_freeze_epochs_under_ddp_train_the_head_then_everything_alike_on_each_rank(tmp_path):
    """--freeze-epochs 1 with 2 processes: DDP is told to find the frozen backbone's unused parameters, so the
    head alone trains in epoch 1 (backbone weights and BatchNorm statistics exactly the pretrained ones: no
    gradient, so no AdamW step or decay), the whole model in epoch 2, and both ranks hold the same weights
    after every step."""
    from imagedata import make_train_val

    make_train_val(tmp_path / "ds", per_class=8, val_per_class=2)
    args = dict(data=str(tmp_path / "ds"), project=str(tmp_path / "runs"), img_size=16, workers=0, epochs=2,
                device="cpu", deterministic=True, model="tiny", pretrained="DEFAULT", freeze_epochs=1,
                batch_size=4, optimizer="adamw", lr=0.01, warmup_epochs=0.0, gpus=2)
    runs = finish(start_ranks("freeze", args), timeout=120)
    assert [rc for rc, _, _ in runs] == [0, 0], [e[-1500:] for _, _, e in runs]
    (_, r0, _), (_, r1, _) = runs
    src = r0["source"]
    frozen = [st for st in r0["steps"] if st["epoch"] == 0]
    thawed = [st for st in r0["steps"] if st["epoch"] == 1]
    assert len(frozen) == len(thawed) == 2  # 16 images, 2 ranks x 4 each per step
    for st in frozen:
        assert (st["conv"], st["bn_w"], st["bn_mean"]) == (src["conv"], src["bn_w"], src["bn_mean"])
    assert frozen[0]["fc"] != frozen[1]["fc"]  # the head learned
    assert thawed[-1]["conv"] != src["conv"] and thawed[-1]["bn_mean"] != src["bn_mean"]
    for a, b in zip(r0["steps"], r1["steps"], strict=True):  # DDP kept the ranks in step
        assert a["conv"] == pytest.approx(b["conv"], abs=1e-6) and a["fc"] == pytest.approx(b["fc"], abs=1e-6)
    for p, q in zip(r0["final"], r1["final"], strict=True):
        assert p == pytest.approx(q, abs=1e-6)


def _read_until(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """Lines of proc's stdout up to the first that starts with `marker` (kills proc after `timeout`)."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"no line starting with {marker!r}:\n{''.join(lines)}{proc.stderr.read()[-3000:]}")

def _stopped_in_epoch_1(args: list[str], env: dict, marker: str):
    """`dlenv train ARGS` launched, SIGTERM once `marker` (epoch 1's line) is out; (process, stdout, stderr)."""
    launcher = subprocess.Popen([sys.executable, "-m", "dlenv", "train", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    try:
        head = _read_until(launcher, marker, timeout=300)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return launcher, "".join(head) + out, err



@pytest.mark.slow
def test_launch_sigterm_saves_once_then_resumes_on_one_process(tmp_path):
    """`dlenv train --gpus 2` through torchrun: SIGTERM to the launcher -> rank 0 saves last.pth once and
    the run exits 143; --resume on one process keeps the effective batch through accumulation."""
    from imagedata import make_train_val

    from dlenv.runfolder import results

    make_train_val(tmp_path / "ds", per_class=8)
    project = tmp_path / "runs"
    common = ["--workers", "0", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    # the signal goes once epoch 1's line is out (the handlers are in place by then) and lands in one of
    # the three epochs left; the timeouts are safety nets far above the phases (13 s to epoch 1, 3 s to
    # stop, 10 s to resume on this 2-core box at load 8; a fixed 10 epochs took the resume past 300 s)
    launcher, out, err = _stopped_in_epoch_1(
        ["--data", str(tmp_path / "ds"), "--model", "squeezenet1_1", "--img-size", "32", "--batch-size", "2",
         "--accum-steps", "2", "--epochs", "4", "--gpus", "2", "--project", str(project), *common], env, "epoch 1/4:")
    assert launcher.returncode == 143, out + err[-3000:]
    assert "batch 2 x 2 accum x 2 GPU = 8" in out
    assert out.count("stopped by SIGTERM; saved") == 1, out
    assert [p.name for p in project.iterdir()] == ["exp"], "only rank 0 creates a run folder"
    ck = torch.load(project / "exp" / "last.pth", map_location="cpu", weights_only=True)
    assert ck["world_size"] == 2 and 1 <= ck["epoch"] < 4

    resumed = subprocess.run([sys.executable, "-m", "dlenv", "train", "--resume", str(project / "exp" / "last.pth"),
                              *common], capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert ("resuming a run of 2 GPU(s) on 1: micro-batch 2 x 4 accumulation x 1 keeps the effective batch 8"
            in resumed.stdout)
    df = results.read_results(project / "exp" / "results.csv")
    assert df["epoch"].tolist() == list(range(1, 5))
    assert df["accum_steps"].iloc[-1] == 4 and df["batch_size"].iloc[-1] == 2


@pytest.mark.slow
def test_the_printed_resume_line_resumes_on_the_processes_launched(tmp_path):
    """`--gpus 2 --dist-timeout 300` stopped by SIGTERM: the resume line it prints names both, and typed as
    printed it resumes on two processes, exactly (no line that it is not bit-equal) (issue 53 item 6)."""
    import shlex

    from imagedata import make_train_val

    from dlenv.runfolder import results

    make_train_val(tmp_path / "ds", per_class=8)
    project = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    launcher, out, err = _stopped_in_epoch_1(
        ["--data", str(tmp_path / "ds"), "--model", "squeezenet1_1", "--img-size", "32", "--batch-size", "2",
         "--epochs", "3", "--gpus", "2", "--dist-timeout", "300", "--project", str(project), "--workers", "0",
         "--device", "cpu"], env, "epoch 1/3:")
    assert launcher.returncode == 143, out + err[-3000:]
    printed = [ln.split("Resume with: ", 1)[1] for ln in out.splitlines() if "Resume with: " in ln]
    assert printed == [f"dlenv train --resume {project / 'exp' / 'last.pth'} --gpus 2 --dist-timeout 300"], out
    words = shlex.split(printed[0])
    resumed = subprocess.run([sys.executable, "-m", "dlenv", *words[1:]], capture_output=True, text=True, env=env,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "batch 2 x 1 accum x 2 GPU = 4" in resumed.stdout
    assert "bit-equal" not in resumed.stdout and "process(es)" not in resumed.stdout
    assert results.read_results(project / "exp" / "results.csv")["epoch"].tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------------------------------
# One process: everything is a no-op.


def test_single_process_helpers_are_no_ops():
    assert distributed.is_main() and distributed.world_size() == 1 and distributed.rank() == 0
    t = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert distributed.reduce_metrics({"a": 2, "b": torch.tensor(3.5)}) == {"a": 2.0, "b": 3.5}
    assert distributed.agree(7, "min") == 7
    distributed.barrier()
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap_ddp(model, torch.device("cpu"), sync_bn=True) is model
    with distributed.no_sync_context(model, False):
        pass


_GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:41234"


@pytest.mark.parametrize("text, rank, world, peer", [
    (_GLOO_CLOSED, 0, 2, "rank 1 of 2"),            # a run of two: the other rank
    (_GLOO_CLOSED, 1, 2, "rank 0 of 2"),
    (_GLOO_CLOSED, 3, 8, "a process on 10.0.0.2"),  # more: the node gloo names
    ("Connection reset by peer [::1]:5000", 0, 4, "a process on ::1"),
    ("Timed out waiting 600000ms for recv operation", 0, 4, ""),  # nothing to tell
], ids=["two-rank0", "two-rank1", "gloo-address", "ipv6", "unknown"])
def test_the_lost_peer_is_named_where_it_can_be(text, rank, world, peer):
    assert distributed.lost_peer(RuntimeError(text), rank, world) == peer


def test_init_from_env_without_torchrun_environment_is_a_user_error(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError, match="RANK is not set"):
        distributed.init_from_env(device="cpu")


def test_init_from_env_refuses_one_fixed_gpu(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="--device cuda:1.*use --device cuda"):
        distributed.init_from_env(device="cuda:1")


# ---------------------------------------------------------------------------------------------------
# Samplers.


@pytest.mark.parametrize("n,world", [(7, 2), (10, 3), (2, 4), (0, 2)])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    shards = [list(distributed.EvalShardSampler(n, r, world)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(distributed.EvalShardSampler(n, r, world)) for r in range(world)] == [len(s) for s in shards]


def test_eval_shard_sampler_rejects_a_bad_rank():
    with pytest.raises(ValueError, match="rank 2"):
        distributed.EvalShardSampler(5, rank=2, world_size=2)


def test_shard_eval_loader_keeps_the_loader_settings_and_reads_one_shard():
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(9.0))
    loader = DataLoader(ds, batch_size=2, shuffle=False)
    assert distributed.shard_eval_loader(loader, 0, 1) is loader
    shard = distributed.shard_eval_loader(loader, 1, 2)
    assert shard.batch_size == 2 and shard.dataset is ds
    assert [x.tolist() for (x,) in shard] == [[1.0, 3.0], [5.0, 7.0]]


def test_shard_eval_loader_keeps_bad_image_handling(tmp_path):
    from imagedata import make_image_folder

    from dlenv.data.loaders import SafeLoader, build_eval_loader

    make_image_folder(tmp_path / "v", per_class=3, size=(16, 16))
    samples = sorted((str(p), 0) for p in (tmp_path / "v").rglob("*.png"))
    (tmp_path / "v" / "cat" / "cat_1.png").write_bytes(b"not a png")
    loader = build_eval_loader(samples, 16, 2, workers=0)
    shard = distributed.shard_eval_loader(loader, 1, 2)  # indices 1, 3, 5: cat_1 is index 1
    assert isinstance(shard, SafeLoader)
    assert sum(len(y) for _, y in shard) == 3
    assert any("cat_1.png" in p for p in shard.bad_paths)


# ---------------------------------------------------------------------------------------------------
# On GPUs (the lead's H200 box).


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_gpus_nccl_sync_bn_and_auto_batch(tmp_path):
    """NCCL, SyncBatchNorm, AMP and --batch-size auto agreed over 2 GPUs, through the real launcher."""
    from dlenv.runfolder import results

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS.parent / "src"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "dlenv", "train", "--synthetic", "--model", "resnet18", "--img-size", "64",
           "--batch-size", "auto", "--amp", "--sync-bn", "--epochs", "2", "--max-steps", "6", "--gpus", "2",
           "--project", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "--batch-size auto:" in p.stdout and "x 2 GPU =" in p.stdout
    df = results.read_results(tmp_path / "exp" / "results.csv")
    assert df["epoch"].tolist() == [1, 2] and (df["img_per_s"] > 0).all()
    ck = torch.load(tmp_path / "exp" / "last.pth", map_location="cpu", weights_only=True)
    assert ck["world_size"] == 2
    assert not any("module." in k for k in ck["model"]), "checkpoints hold the bare model's keys"


# ---------------------------------------------------------------------------------------------------
# A stopped run of two ranks resumes exactly.


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "last.pth", map_location="cpu", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_stopped_mid_epoch_and_resumed_end_bit_equal_to_an_uninterrupted_run(tmp_path, workers):
    """Random crops and flips (in the main process, or in 2 DataLoader workers per rank), dropout and BatchNorm:
    each rank draws its own random numbers. SIGTERM reaches rank 0 after optimizer step 9 (epoch 2 of 3); the
    ranks stop there, rank 0 saves every rank's random streams, and the resume on two ranks ends with exactly
    the weights of a run that was never stopped."""
    _stopped_and_resumed_exactly(tmp_path, workers, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_two_ranks_stopped_mid_epoch_and_resumed_end_bit_equal_to_an_uninterrupted_run(tmp_path):
    """The same on two GPUs (NCCL, --deterministic, 2 DataLoader workers a rank): the CUDA streams are each
    rank's own too."""
    _stopped_and_resumed_exactly(tmp_path, 2, "cuda")


def _stopped_and_resumed_exactly(tmp_path: Path, workers: int, device: str) -> None:
    from imagedata import make_train_val

    from dlenv.files import runstate

    make_train_val(tmp_path / "ds", per_class=16, val_per_class=2)  # 32 images: 8 steps of 2 x 2 an epoch
    base = dict(data=str(tmp_path / "ds"), img_size=16, workers=workers, epochs=3, device=device, deterministic=True,
                model="tiny", batch_size=2, lr=0.1, seed=5, gpus=2, vote_s=0.0)
    whole = start_ranks("exact", dict(base, project=str(tmp_path / "whole")))
    cut = start_ranks("exact", dict(base, project=str(tmp_path / "cut"), stop_at=9))
    whole_runs, cut_runs = finish(whole), finish(cut)
    assert [rc for rc, _, _ in whole_runs] == [0, 0], [e[-1500:] for _, _, e in whole_runs]
    assert [rc for rc, _, _ in cut_runs] == [143, 143], [e[-1500:] for _, _, e in cut_runs]
    last = tmp_path / "cut" / "exp" / "last.pth"
    saved = runstate.load_state(last)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (1, 9, 1)
    assert len(saved["rng_ranks"]) == 2
    assert not torch.equal(saved["rng_ranks"][0]["torch"], saved["rng_ranks"][1]["torch"])

    resumed = finish(start_ranks("exact", dict(base, project=str(tmp_path / "cut"), resume=str(last))))
    assert [rc for rc, _, _ in resumed] == [0, 0], [e[-1500:] for _, _, e in resumed]
    want, got = _final_weights(tmp_path / "whole" / "exp"), _final_weights(tmp_path / "cut" / "exp")
    assert set(want) == set(got)
    diff = max((want[k].double() - got[k].double()).abs().max().item() for k in want if want[k].is_floating_point())
    assert diff == 0.0, f"max weight difference {diff}"
    assert all(torch.equal(want[k], got[k]) for k in want)
