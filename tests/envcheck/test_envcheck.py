"""dlenv.envcheck (facts, pins, kernels, judge, render): made-up facts through the real checks, the kernel
comparison on the CPU, the command on this machine, and (marked gpu) the whole check passing on a real GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv import envcheck
from dlenv.envcheck import Facts, Gpu, Kernel, kernels
from dlenv.options.config import VerifyEnvConfig, build

ROOT = Path(__file__).resolve().parents[2]
MiB, GiB = 2**20, 2**30

# torch 1.13.1+cu116's torch.cuda.get_arch_list(): no sm_90, no PTX.
ARCHS_113 = ["sm_37", "sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86"]
ARCHS_MODERN = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


def gpu_facts(capability=(8, 0), archs=ARCHS_113, name="NVIDIA A100", kernels=None, **kw) -> Facts:
    """Facts of a healthy one-GPU cu116 machine; keyword arguments override fields."""
    if kernels is None:
        kernels = [Kernel(op, dt, True, 1e-4) for dt in envcheck.kernel_dtypes(capability)
                   for op in ("conv2d", "matmul")]
    base = dict(
        versions={"dlenv": "0.1.0", "python": "3.10.14", "torch": "1.13.1", "torchvision": "0.14.1",
                  "torchaudio": "0.13.1", "cuda": "11.6", "cudnn": "8.3.2", "numpy": "1.26.4",
                  "opencv": "4.11.0"},
        pins={"python": "==3.10.*", "torch": "==1.13.1.*", "torchvision": "==0.14.1.*",
              "torchaudio": "==0.13.1.*", "cuda": "==11.6.*", "numpy": ">=1.23,<2", "opencv": ">=4.8,<4.12"},
        env_file="/opt/dlenv/environment.yml", torch_cuda="11.6", cuda_available=True, arch_list=archs,
        driver="535.104.05", driver_cuda="12.2", smi_gpus=1,
        gpus=[Gpu(0, name, 80 * GiB, capability, kernels)],
        cpus=16, host_cpus=16, workers=8, workers_auto=True, shm_per_worker=116 * MiB,
        shm_total=64 * GiB, shm_free=64 * GiB, disk_path="/root/workspace", disk_free=500 * GiB,
        in_container=True)
    base.update(kw)
    return Facts(**base)


def judge(facts: Facts, allow_cpu: bool = False):
    results = envcheck.checks(facts, allow_cpu)
    ok, line = envcheck.verdict(facts, results, allow_cpu)
    return results, ok, line


def by_name(results, name):
    return next(c for c in results if c.name == name)


def test_healthy_gpu_machine_passes():
    results, ok, line = judge(gpu_facts())
    assert ok, line
    assert line.startswith("PASS") and "NVIDIA A100" in line
    assert by_name(results, "GPU 0").status == "ok"
    assert by_name(results, "kernels 0").status == "ok"
    assert all(c.status != "fail" for c in results)


def test_sm90_on_the_default_profile_names_the_modern_profile():
    facts = gpu_facts(capability=(9, 0), name="NVIDIA H200", kernels=[])
    results, ok, line = judge(facts)
    gpu = by_name(results, "GPU 0")
    assert not ok
    assert gpu.status == "fail" and "sm_90" in gpu.detail
    assert "environment.modern.yml" in gpu.fix and gpu.fix.count("\n") == 0
    assert "modern profile" in line and "\n" not in line


def test_same_gpu_is_fine_on_the_modern_arch_list():
    facts = gpu_facts(capability=(9, 0), name="NVIDIA H200", archs=ARCHS_MODERN)
    assert judge(facts)[1]


def test_ada_runs_the_sm86_code_of_the_default_profile():
    results, ok, _ = judge(gpu_facts(capability=(8, 9), name="NVIDIA L4"))
    assert ok and by_name(results, "GPU 0").status == "ok"


def test_failed_kernel_fails_and_names_the_dtype():
    kernels = [Kernel("conv2d", "fp32", True, 1e-4), Kernel("matmul", "fp16", False, 0.3)]
    results, ok, line = judge(gpu_facts(kernels=kernels))
    k = by_name(results, "kernels 0")
    assert not ok and k.status == "fail"
    assert "matmul fp16" in k.detail and "conv2d" not in k.detail


def test_no_kernel_image_error_points_to_the_modern_profile():
    kernels = [Kernel("conv2d", "fp32", False, None, "RuntimeError: CUDA error: no kernel image is "
                      "available for execution on the device")]
    results, ok, _ = judge(gpu_facts(kernels=kernels))
    assert not ok and "modern" in by_name(results, "kernels 0").fix


def test_small_shm_with_8_workers_warns_with_ipc_host():
    facts = gpu_facts(shm_total=64 * MiB, shm_free=64 * MiB, workers=8, workers_auto=False)
    results, ok, _ = judge(facts)
    shm = by_name(results, "/dev/shm")
    assert ok  # training still runs (with fewer workers); it is a warning
    assert shm.status == "warn" and "the trainer uses" in shm.detail
    assert "--ipc=host" in shm.fix and "--shm-size" in shm.fix


def test_small_shm_with_auto_workers_says_how_many_auto_keeps():
    facts = gpu_facts(shm_total=512 * MiB, shm_free=512 * MiB, workers=8, workers_auto=True)
    shm = by_name(judge(facts)[0], "/dev/shm")
    assert shm.status == "warn" and "auto drops to 2 workers" in shm.detail


@pytest.mark.parametrize("gpu", [True, False], ids=["device-path", "classic-path"])
@pytest.mark.parametrize("cpus,shm_mib", [(16, 64), (16, 512), (16, 1024), (16, 2048), (16, 65536), (4, 512),
                                          (64, 4096)])
def test_shm_verdict_says_the_workers_the_trainer_starts(monkeypatch, gpu, cpus, shm_mib):
    """verify-env's /dev/shm line and the trainer's `--workers auto` size the same batches in flight:
    uint8 stored squares with a GPU (the default path there), float32 crops without one."""
    from collections import namedtuple

    from dlenv.data import workers
    from dlenv.envcheck.facts import TRAIN_BATCH, TRAIN_IMG, _shm_per_worker
    from dlenv.options.cpus import auto_workers

    auto = auto_workers(cpus)
    facts = gpu_facts(workers=auto, workers_auto=True, shm_per_worker=_shm_per_worker(gpu), shm_total=shm_mib * MiB,
                      shm_free=shm_mib * MiB)
    shm = by_name(judge(facts)[0], "/dev/shm")
    monkeypatch.setattr(workers, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(workers.shutil, "disk_usage",
                        lambda p: namedtuple("Usage", "total used free")(shm_mib * MiB, 0, shm_mib * MiB))
    started, _ = workers.decide_workers("auto", TRAIN_BATCH, TRAIN_IMG,
                                        sample_bytes=workers.shipped_bytes(TRAIN_IMG, True) if gpu else None)
    if started == auto:
        assert shm.status == "ok", shm.detail
    else:
        assert shm.status == "warn" and f"auto drops to {started} worker" in shm.detail, (started, shm.detail)


def test_host_ipc_shm_is_fine_and_zero_workers_need_none():
    assert by_name(judge(gpu_facts())[0], "/dev/shm").status == "ok"
    facts = gpu_facts(shm_total=64 * MiB, shm_free=64 * MiB, workers=0, workers_auto=False)
    assert by_name(judge(facts)[0], "/dev/shm").status == "ok"


def cpu_facts(**kw) -> Facts:
    none = dict(gpus=[], cuda_available=False, driver=None, driver_cuda=None, smi_gpus=0)
    return gpu_facts(**{**none, **kw})


def test_no_gpu_fails_unless_allow_cpu():
    results, ok, line = judge(cpu_facts())
    assert not ok and "--gpus all" in line and "--allow-cpu" in line and "\n" not in line
    results, ok, line = judge(cpu_facts(), allow_cpu=True)
    assert ok and "--allow-cpu" in line
    assert by_name(results, "GPU").status == "warn"


def test_no_gpu_outside_a_container_does_not_mention_docker():
    results, ok, line = judge(cpu_facts(in_container=False))
    assert not ok and "--gpus" not in line and "nvidia-smi" in line


def test_driver_too_old_for_the_cuda_runtime():
    facts = gpu_facts(torch_cuda="12.8", driver="470.82.01", driver_cuda="11.4")
    results, ok, _ = judge(facts)
    d = by_name(results, "driver")
    assert not ok and d.status == "fail" and "525.60.13" in d.fix
    # same major, older minor: runs through minor version compatibility, so only a warning
    facts = gpu_facts(torch_cuda="11.6", driver="470.82.01", driver_cuda="11.4")
    assert by_name(judge(facts)[0], "driver").status == "warn"


def test_torch_warning_about_an_old_driver_is_explained():
    facts = cpu_facts(smi_gpus=1, driver="418.67", cuda_warning="The NVIDIA driver on your system is "
                      "too old (found version 10010).")
    results, ok, line = judge(facts)
    assert not ok and "found version 10010" in line and "450.80.02" in line


def test_cpu_only_torch_build_fails():
    facts = cpu_facts(torch_cuda=None, versions={**gpu_facts().versions, "cuda": None})
    results, ok, _ = judge(facts)
    assert not ok and by_name(results, "CUDA build").status == "fail"
    assert judge(facts, allow_cpu=True)[1]


def test_version_off_its_pin_warns_and_broken_import_fails():
    facts = gpu_facts(versions={**gpu_facts().versions, "torchvision": "0.15.2"})
    tv = by_name(judge(facts)[0], "torchvision")
    assert tv.status == "warn" and "0.14.1" in tv.detail
    facts = gpu_facts(import_errors={"torch": "ImportError: libtorch_cpu.so: undefined symbol: "
                                              "iJIT_NotifyEvent"})
    results, ok, line = judge(facts)
    assert not ok and "mkl<2024.1" in by_name(results, "torch").fix


def test_numpy_2_with_torch_1_fails():
    facts = gpu_facts(versions={**gpu_facts().versions, "numpy": "2.1.0"})
    results, ok, _ = judge(facts)
    assert not ok and any("numpy<2" in c.fix for c in results if c.status == "fail")


def test_low_disk_warns():
    assert by_name(judge(gpu_facts(disk_free=2 * GiB))[0], "disk").status == "warn"


def test_pins_of_both_env_files_are_read_with_requirements():
    pins = envcheck.read_pins(ROOT / "environment.yml")
    assert pins["torch"] == "==1.13.1.*" and pins["cuda"] == "==11.6.*" and pins["python"] == "==3.10.*"
    assert pins["opencv"].startswith(">=")  # from requirements.txt via -r
    assert envcheck.profile_name(pins) == "cu116"
    modern = envcheck.read_pins(ROOT / "environment.modern.yml")
    assert modern["torch"].startswith("==2.") and "+cu12" in modern["torch"]
    assert envcheck.profile_name(modern).startswith("cu12")


def test_read_pins_of_a_made_up_env_file(tmp_path):
    (tmp_path / "req.txt").write_text("numpy>=1.23,<2  # comment\n-r more.txt\n")
    (tmp_path / "more.txt").write_text("opencv-python-headless<4.12\n")
    (tmp_path / "env.yml").write_text(
        "name: dl\ndependencies:\n  - python=3.11\n  - pip:\n"
        "      - --extra-index-url https://example.invalid/whl\n      - torch==2.7.1+cu128\n"
        "      - -r req.txt\n")
    pins = envcheck.read_pins(tmp_path / "env.yml")
    assert pins == {"python": "==3.11.*", "torch": "==2.7.1+cu128", "numpy": ">=1.23,<2",
                    "opencv": "<4.12", "cuda": "==12.8.*"}


@pytest.mark.parametrize("installed, spec, expected", [
    ("1.13.1", "==1.13.1.*", True), ("1.13.1+cu116", "==1.13.1.*", True), ("3.10.14", "==3.10.*", True),
    ("3.11.2", "==3.10.*", False), ("2.11.0+cu128", "==2.11.0+cu128", True),
    ("2.11.0+cu130", "==2.11.0+cu128", False), ("2.0.1", ">=1.23,<2", False), ("11.6", "==11.6.*", True),
])
def test_pin_matches(installed, spec, expected):
    assert envcheck.pin_matches(installed, spec) is expected


def test_parsers():
    assert envcheck.cudnn_string(8302) == "8.3.2" and envcheck.cudnn_string(90100) == "9.1.0"
    assert envcheck.cuda_string(12040) == "12.4" and envcheck.cuda_string(11060) == "11.6"
    rows = envcheck.parse_nvidia_smi("0, NVIDIA H200, 143771, 550.54.15\n1, NVIDIA H200, 143771, "
                                     "550.54.15\nNo devices were found\n")
    assert [r["index"] for r in rows] == [0, 1] and rows[0]["memory_mib"] == 143771
    assert rows[0]["driver"] == "550.54.15"


def test_relative_error_and_nonfinite():
    import torch

    ref = torch.tensor([1.0, -4.0, 2.0])
    assert envcheck.relative_error(ref.clone(), ref) == 0.0
    assert envcheck.relative_error(ref + torch.tensor([0.0, 0.4, 0.0]), ref) == pytest.approx(0.1)
    assert envcheck.relative_error(torch.tensor([1.0, float("nan"), 2.0]), ref) == float("inf")


@pytest.mark.parametrize("op", ["conv2d", "matmul"])
def test_kernel_check_on_cpu_measures_a_small_error(op):
    k = envcheck.kernel_check("cpu", op, "fp32")
    assert k.passed and k.error is not None and k.error < 1e-5 and not k.message


def test_kernel_check_catches_wrong_results(monkeypatch):
    real = kernels.cases()
    # the 'device' run (first call) returns slightly wrong results, the reference does not
    calls = {"n": 0}

    def skewed(a, b):
        calls["n"] += 1
        return a @ b * (1.05 if calls["n"] == 2 else 1.0)  # call 1 only finds the output shape

    monkeypatch.setattr(kernels, "cases", lambda: {**real, "matmul": ((8, 8), (8, 8), skewed)})
    k = envcheck.kernel_check("cpu", "matmul", "fp32")
    assert not k.passed and k.error == pytest.approx(0.05, rel=0.2)


def test_bf16_only_from_ampere():
    assert envcheck.kernel_dtypes((7, 5)) == ["fp32", "fp16"]
    assert envcheck.kernel_dtypes((9, 0)) == ["fp32", "fp16", "bf16"]


@pytest.mark.parametrize("version,engines,fix,status,says", [
    ("0.9.0", True, "", "ok", "hardware JPEG engines (nvImageCodec 0.9.0): --decoder auto uses them"),
    ("0.6.1", False, "", "info", "no hardware JPEG engines on this GPU (nvImageCodec 0.6.1)"),
    (None, None, "pip install 'nvidia-nvimgcodec-cu11[nvjpeg]'", "info", "nvImageCodec not installed"),
])
def test_the_gpus_jpeg_engines_are_reported_never_failed(version, engines, fix, status, says):
    facts = gpu_facts(nvimgcodec=version, nvimgcodec_fix=fix)
    facts.gpus[0].jpeg_engines = engines
    results, ok, _ = judge(facts)
    check = by_name(results, "jpeg 0")
    assert ok and check.status == status and says in check.detail, check
    assert (fix in check.fix) if fix else check.fix == ""


def test_no_jpeg_row_for_a_gpu_whose_kernels_fail():
    facts = gpu_facts(kernels=[Kernel("conv2d", "fp32", False, 1.0)])
    assert not any(c.name == "jpeg 0" for c in judge(facts)[0])


def test_screen_fits_and_json_is_complete():
    facts = gpu_facts(capability=(9, 0), archs=ARCHS_MODERN, name="NVIDIA H200")
    results, ok, line = judge(facts)
    text = envcheck.render_text(facts, results, line)
    assert len(text.splitlines()) < 30 and max(map(len, text.splitlines())) < 160
    assert "sm_90" in text and "profile cu116" in text
    data = json.loads(envcheck.render_json(facts, results, ok, line))
    assert data["ok"] is True and data["facts"]["gpus"][0]["capability"] == [9, 0]
    assert {c["name"] for c in data["checks"]} >= {"torch", "GPU 0", "kernels 0", "/dev/shm", "disk"}


def test_collect_on_this_machine_is_consistent(tmp_path):
    facts = envcheck.collect(workers=3, workspace=tmp_path)
    import torch

    assert facts.versions["torch"] == torch.__version__
    assert facts.workers == 3 and not facts.workers_auto
    assert facts.disk_path == str(tmp_path.resolve()) and facts.disk_free > 0
    assert 1 <= facts.cpus <= facts.host_cpus
    assert len(facts.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _verify_env(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlenv", "verify-env", *flags], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the CPU-only behaviour")
def test_command_on_a_cpu_machine_fails_with_one_line_and_passes_with_allow_cpu(capsys):
    r = _verify_env()
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "--allow-cpu" in r.stderr
    assert "torch" in r.stdout  # the screen itself is still printed
    # --allow-cpu in-process (torch is imported already: no second slow start)
    assert envcheck.main(build(VerifyEnvConfig, allow_cpu=True, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_main_returns_the_verdict(monkeypatch, capsys):
    monkeypatch.setattr(envcheck, "collect", lambda workers: gpu_facts(workers=8))
    assert envcheck.main(build(VerifyEnvConfig)) == 0
    monkeypatch.setattr(envcheck, "collect", lambda workers: cpu_facts())
    assert envcheck.main(build(VerifyEnvConfig)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verify-env: FAIL")


@pytest.mark.gpu
def test_verify_env_passes_on_this_gpu_with_every_kernel_check():
    r = _verify_env("--json")
    data = json.loads(r.stdout)
    assert r.returncode == 0, data["verdict"]
    gpus = data["facts"]["gpus"]
    assert gpus, "no GPU in the facts"
    for gpu in gpus:
        assert gpu["kernels"], f"no kernel checks ran on GPU {gpu['index']}"
        assert all(k["passed"] for k in gpu["kernels"]), gpu["kernels"]
        dtypes = {k["dtype"] for k in gpu["kernels"]}
        assert dtypes == set(envcheck.kernel_dtypes(tuple(gpu["capability"])))
        assert {k["op"] for k in gpu["kernels"]} == {"conv2d", "matmul"}
    screen = _verify_env()
    assert screen.returncode == 0 and "sm_" in screen.stdout
    print(screen.stdout)  # the screen, for `pytest -s` logs


@pytest.mark.parametrize("environ,prefix,base,conda_meta,kind", [
    ({"DLENV_IMAGE": "1", "CONDA_PREFIX": "/opt/conda/envs/dl"}, "/opt/conda/envs/dl", "/opt/conda", True, "image"),
    ({"CONDA_PREFIX": "{p}"}, "{p}", "/usr", False, "conda"),     # an activated conda env
    ({}, "{p}", "/usr", True, "conda"),                            # a conda env's python run by path
    ({"CONDA_PREFIX": "/opt/conda"}, "{p}", "/usr", False, "venv"),  # a venv made inside conda's base
    ({}, "/usr", "/usr", False, "pip"),                             # system or --user packages
])
def test_install_kind(tmp_path, environ, prefix, base, conda_meta, kind):
    from dlenv.envcheck.facts import install_kind

    p = str(tmp_path)
    if conda_meta and prefix == "{p}":
        (tmp_path / "conda-meta").mkdir()
    environ = {k: v.replace("{p}", p) for k, v in environ.items()}
    assert install_kind(environ, prefix.replace("{p}", p), base) == kind


@pytest.mark.parametrize("install,says,never", [
    ("image", "rebuild the image", "pip install"),
    ("conda", "conda env update -f /opt/dlenv/environment.yml", "rebuild the image (docker"),
    ("venv", "python -m pip install 'torch==1.13.1'", "conda"),
    ("pip", "python -m pip install --user 'torch==1.13.1'", "conda"),
])
def test_version_advice_fits_how_it_was_installed(install, says, never):
    facts = gpu_facts(install=install, versions={**gpu_facts().versions, "torch": "1.12.0"})
    fix = by_name(envcheck.checks(facts), "torch").fix
    assert says in fix and never not in fix


@pytest.mark.parametrize("install,allow_cpu,says,never", [
    ("venv", False, "pip install torch==1.13.1 --index-url https://download.pytorch.org/whl/cu116", "conda"),
    ("venv", False, "pass --allow-cpu", "rebuild"),
    ("venv", True, "--index-url", "pass --allow-cpu"),  # already allowed: not told again
    ("conda", False, "conda env update", "pip install"),
])
def test_cpu_build_advice_fits_how_it_was_installed(install, allow_cpu, says, never):
    facts = gpu_facts(install=install, torch_cuda=None, cuda_available=False, gpus=[], smi_gpus=0,
                      versions={**gpu_facts().versions, "torch": "1.13.1+cpu", "cuda": None})
    fix = by_name(envcheck.checks(facts, allow_cpu), "CUDA build").fix
    assert says in fix and never not in fix


# --------------------------------------------------------------------------------------------------
# Advice that fits where verify-env runs: every fix it names is one that exists there.


def test_a_cuda_pin_mismatch_without_a_gpu_needs_no_fix_and_never_pip_installs_cuda():
    facts = cpu_facts(install="venv", in_container=False, versions={**gpu_facts().versions, "cuda": "11.7"})
    cuda = by_name(judge(facts, allow_cpu=True)[0], "cuda")
    assert cuda.status == "info" and "not used" in cuda.detail and not cuda.fix


def test_a_cuda_pin_mismatch_on_a_gpu_in_a_venv_names_the_torch_build_to_install():
    facts = gpu_facts(install="venv", in_container=False, versions={**gpu_facts().versions, "cuda": "11.7"})
    cuda = by_name(judge(facts)[0], "cuda")
    assert cuda.status == "warn" and "'cuda==" not in cuda.fix
    assert "pip install torch==1.13.1 --index-url https://download.pytorch.org/whl/cu116" in cuda.fix
    image = by_name(judge(gpu_facts(versions={**gpu_facts().versions, "cuda": "11.7"}))[0], "cuda")
    assert "rebuild the image" in image.fix and "pip" not in image.fix


def test_gpus_all_is_named_only_in_dlenvs_image_and_not_with_allow_cpu():
    venv_in_a_container = cpu_facts(install="venv", in_container=True)
    assert "--gpus" not in judge(venv_in_a_container)[2]
    assert "--gpus all" in judge(cpu_facts(install="image", in_container=True))[2]
    gpu = by_name(judge(cpu_facts(install="image"), allow_cpu=True)[0], "GPU")
    assert not gpu.fix and "runs on the CPU" in gpu.detail


def test_collect_asks_each_working_gpu_for_jpeg_engines(monkeypatch):
    import types

    import torch

    from dlenv.data import hwdecode
    from dlenv.envcheck import facts as facts_mod

    asked = []
    monkeypatch.setattr(hwdecode, "module", lambda: (types.SimpleNamespace(__version__="0.9.0"), None))
    monkeypatch.setattr(hwdecode, "has_engines", lambda device: asked.append(str(device)) or True)
    facts = gpu_facts()
    facts.gpus.append(Gpu(1, "NVIDIA H200", 141 * GiB, (9, 0), [Kernel("conv2d", "fp32", False, 1.0)]))
    facts_mod._collect_jpeg_engines(torch, facts)
    assert facts.nvimgcodec == "0.9.0" and asked == ["cuda:0"]  # GPU 1's kernels failed: not asked
    assert facts.gpus[0].jpeg_engines is True and facts.gpus[1].jpeg_engines is None
    monkeypatch.setattr(hwdecode, "module", lambda: (None, "nvImageCodec is not installed"))
    facts = gpu_facts()
    facts_mod._collect_jpeg_engines(torch, facts)
    assert facts.nvimgcodec is None and facts.nvimgcodec_fix.startswith("pip install 'nvidia-nvimgcodec-cu")


@pytest.mark.parametrize("torch_version, says", [("1.13.1", True), ("2.11.0+cu128", False)])
def test_the_default_profile_points_a_2x_script_to_the_modern_profile(torch_version, says):
    facts = gpu_facts()
    facts.versions["torch"] = torch_version
    results, ok, _ = judge(facts)
    found = [c for c in results if c.name == "scripts"]
    assert bool(found) is says
    if says:
        assert found[0].status == "info" and "torch.accelerator" in found[0].detail
        assert "modern profile" in found[0].fix and "docs/docker.md" in found[0].fix
