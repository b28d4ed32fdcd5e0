"""Several machines: two `dlenv train --nnodes 2` launches on 127.0.0.1 form one gloo run and end with the
same weights; the Kubernetes manifest of docs/distributed.md starts it the same way.

Each launch is what one node runs (its own working directory standing for its own disk): `dlenv train`
starts torchrun with --nnodes 2 --node-rank R --master-addr --master-port, and torchrun starts one CPU
process. To compare the weights every node ends with, not only rank 0's last.pth, a sitecustomize on
PYTHONPATH (only in the training processes, only in this test) saves each rank's DDP module when the
run leaves its process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from dlenv import runfolder
from dlenv.cluster import launch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_SITECUSTOMIZE = textwrap.dedent("""
    import os

    if os.environ.get("DLENV_TEST_DUMP") and "LOCAL_RANK" in os.environ:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        _wrapped = []
        _init = DistributedDataParallel.__init__

        def _record(self, module, *args, **kwargs):
            _init(self, module, *args, **kwargs)
            _wrapped.append(module)

        _destroy = dist.destroy_process_group

        def _dump(*args, **kwargs):
            if _wrapped:
                state = {k: v.detach().cpu().clone() for k, v in _wrapped[-1].state_dict().items()}
                torch.save(state, os.path.join(os.environ["DLENV_TEST_DUMP"], f"rank{os.environ['RANK']}.pt"))
            return _destroy(*args, **kwargs)

        DistributedDataParallel.__init__ = _record
        dist.destroy_process_group = _dump
""")


@pytest.mark.slow
def test_two_nodes_one_process_each_train_together_to_identical_weights(tmp_path):
    import torch
    from imagedata import make_train_val

    from dlenv.files import runstate

    data = tmp_path / "ds"
    make_train_val(data, per_class=8, size=(32, 32))
    site, dumps = tmp_path / "site", tmp_path / "dumps"
    site.mkdir()
    dumps.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src")]), DLENV_TEST_DUMP=str(dumps),
               OMP_NUM_THREADS="1")
    port = launch.free_port()
    nodes = []
    for rank in (0, 1):
        home = tmp_path / f"node{rank}"
        home.mkdir()
        cmd = [sys.executable, "-m", "dlenv", "train", "--data", str(data), "--model", "squeezenet1_1",
               "--img-size", "32", "--batch-size", "2", "--epochs", "2", "--max-steps", "3", "--workers", "0",
               "--device", "cpu", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--dist-timeout", "120"]
        nodes.append(subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outs = [p.communicate(timeout=400)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, out) in enumerate(zip(nodes, outs, strict=True)):
        assert p.returncode == 0, f"node {rank}:\n{out[-3000:]}"
    assert "batch 2 x 1 accum x 2 GPU = 4" in outs[0], outs[0][-2000:]  # one run of world size 2

    run = tmp_path / "node0" / "runs" / "exp"
    assert not (tmp_path / "node1" / "runs").exists(), "only rank 0 writes"
    saved = runstate.load_state(run / "last.pth")
    assert saved["world_size"] == 2 and saved["epoch"] == 2 and saved["step"] == 6
    ranks = [torch.load(dumps / f"rank{r}.pt", map_location="cpu") for r in (0, 1)]
    assert set(ranks[0]) == set(ranks[1]) == set(saved["model"])
    for name, tensor in ranks[0].items():
        assert torch.equal(tensor, ranks[1][name]), f"{name} differs between the nodes"
        assert torch.equal(tensor, saved["model"][name]), f"{name} differs from last.pth"


# ---------------------------------------------------------------------------------------------------
# The Kubernetes manifest (the Slurm script: tests/cluster/test_slurm_script.py, and on a cluster
# tests/cluster/test_slurm.py)


def test_the_kubernetes_manifest_runs_one_indexed_pod_per_node():
    docs = list(yaml.safe_load_all((DOCS / "k8s-train.yaml").read_text(encoding="utf-8")))
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    spec = job["spec"]
    nodes = spec["completions"]
    assert spec["parallelism"] == nodes and spec["completionMode"] == "Indexed"
    assert service["spec"]["clusterIP"] == "None"  # headless: each pod gets a DNS name
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    args = container["args"][container["args"].index("train"):]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--nnodes"] == str(nodes)
    # the node rank is the pod's completion index, read from the annotation the Job controller sets
    var = flags["--node-rank"]
    assert var.startswith("$(") and var.endswith(")")
    (rank_env,) = [e for e in container["env"] if e["name"] == var[2:-1]]
    assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert "command" not in container, "command would replace the image's ENTRYPOINT (tini)"
    master = flags["--master-addr"]
    assert master.startswith(f"{job['metadata']['name']}-0.{service['metadata']['name']}")
    assert int(flags["--gpus"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    port = int(flags.get("--master-port", 29500))
    assert port in [p["port"] for p in service["spec"]["ports"]]
    shm = next(v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
    assert any(m["mountPath"] == "/dev/shm" and m["name"] == shm["name"] for m in container["volumeMounts"])
    assert job["spec"]["backoffLimit"] == 0  # a failed node fails the job; resume with --resume


# ---------------------------------------------------------------------------------------------------
# A resume goes on where the run was.


@pytest.mark.parametrize("saved, given, want", [
    ("cpu", "auto", "cpu"),      # a CPU run stays on the CPU without --device cpu typed again
    ("cpu", "cuda", "cuda"),     # a device given is taken
    ("auto", "auto", "auto"),
    ("cuda", "auto", "cuda"),
    (None, "auto", "auto"),      # no config.yaml beside the file: the trainer says what is wrong
])
def test_a_resume_takes_the_runs_device_unless_one_is_given(tmp_path, saved, given, want):
    from dlenv.options import config
    from dlenv.options.config import TrainConfig

    run = tmp_path / "runs" / "cut"
    run.mkdir(parents=True)
    (run / "last.pth").write_bytes(b"")
    if saved:
        (run / "config.yaml").write_text(f"# dlenv train\nmodel: small_cnn\ndevice: {saved}\nepochs: 3\n")
    cfg = config.build(TrainConfig, resume=str(run / "last.pth"), device=given, nnodes=2,
                       project=str(tmp_path / "runs"))
    assert runfolder.resumed_device(cfg).device == want
    assert runfolder.resumed_device(config.build(TrainConfig, device=given)).device == given  # no resume: as given


@pytest.mark.parametrize("opts, line", [
    (dict(gpus=1, nnodes=2), "--gpus 1 --nnodes 2: no CUDA GPU is visible (run verify-env); use --device cpu to run "
                             "1 CPU process on each node"),
    (dict(gpus=2), "--gpus 2: no CUDA GPU is visible (run verify-env); use --device cpu to run 2 CPU processes, or "
                   "leave --gpus out for one process"),
    (dict(gpus=4, nnodes=2), "--gpus 4 --nnodes 2: no CUDA GPU is visible (run verify-env); use --device cpu to run "
                             "4 CPU processes on each node"),
])
def test_without_a_gpu_the_launch_names_the_cpu_not_the_flag_that_failed(monkeypatch, opts, line):
    import torch

    from dlenv.errors import UserError
    from dlenv.options import config
    from dlenv.options.config import TrainConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as e:
        launch.check_launch(config.build(TrainConfig, **opts))
    assert str(e.value) == line
    assert f"use --gpus {opts['gpus']}" not in str(e.value)


@pytest.mark.slow
def test_two_node_launches_resume_a_cpu_run_without_device_cpu_typed_again(tmp_path, monkeypatch):
    """The issue's case: two `--nnodes 2` launches resuming runs/cut/last.pth with no --device, where no GPU is
    visible (CUDA_VISIBLE_DEVICES empty): they go on on the CPU, as the run was."""
    from imagedata import make_train_val

    make_train_val(tmp_path / "ds", per_class=4, val_per_class=1)
    port = str(launch.free_port())
    common = ["--data", str(tmp_path / "ds"), "--img-size", "32", "--model", "small_cnn", "--epochs", "1",
              "--batch-size", "2", "--workers", "0", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

    def both(args: list[str], port: str) -> list[subprocess.CompletedProcess]:
        procs = [subprocess.Popen([sys.executable, "-m", "dlenv", "train", *args, port, "--node-rank", str(r)],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in (0, 1)]
        return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), p.stdout.read(), "") for p in procs]

    first = both(["--device", "cpu", "--name", "cut", *common], port)
    assert [p.returncode for p in first] == [0, 0], first[0].stdout[-2000:]
    again = both(["--resume", "runs/cut/last.pth", *common[-5:]], str(launch.free_port()))
    assert [p.returncode for p in again] == [0, 0], again[0].stdout[-2000:] + again[1].stdout[-2000:]
    assert "no CUDA GPU is visible" not in again[0].stdout
