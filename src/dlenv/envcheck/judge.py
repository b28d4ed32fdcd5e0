"""Each fact judged: ok / warn / fail / info, with the one line that says what to do; then the verdict."""

from __future__ import annotations

from dataclasses import dataclass

from dlenv.envcheck.facts import Facts, Gpu
from dlenv.envcheck.kernels import TOLERANCE
from dlenv.envcheck.pins import MODERN_ENV_FILE, pin_matches
from dlenv.files import requirements
from dlenv.options.cpus import SMALL_SHM, workers_that_fit

#: Oldest Linux driver per CUDA major version (CUDA's minor version compatibility covers the rest).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# Packages on the screen, in order, and the name each has in requirements files / env files.
PACKAGES = ("dlenv", "python", "torch", "torchvision", "torchaudio", "cuda", "cudnn", "numpy", "opencv")
# Without these, nothing trains; the others (torchaudio, OpenCV) only warn.
_ESSENTIAL = ("torch", "torchvision", "numpy")

MODERN_FIX = (f"build the modern profile (PyTorch 2.x with sm_90/sm_100/sm_120 kernels): "
              f"--build-arg ENV_FILE={MODERN_ENV_FILE}, see docs/docker.md")



@dataclass(frozen=True)
class Check:
    """One judged fact: status is ok, warn, fail or info; `fix` is the one line that says what to do."""

    status: str
    name: str
    detail: str
    fix: str = ""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB", "MiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _pip_spec(spec: str) -> str:
    return spec[:-2] if spec.endswith(".*") else spec  # ==1.13.* -> ==1.13 (pip takes the newest 1.13.x)


def _shown_pin(spec: str) -> str:
    return spec[2:-2] if spec.startswith("==") and spec.endswith(".*") else spec


def reinstall(facts: Facts, what: str = "") -> str:
    """The command that puts the profile's packages (or `what`, a pip spec) back, in the way this
    Python was installed: a venv user cannot act on "rebuild the image", nor an image user on pip."""
    where = facts.env_file or "environment.yml"
    if facts.install == "image":
        return f"rebuild the image (docker build), or conda env update -n dl -f {where}"
    if facts.install == "conda":
        return f"conda env update -f {where} in this conda env (or rebuild the image)"
    pip = "python -m pip install" + ("" if facts.install == "venv" else " --user")
    return f"{pip} {what!r} in this Python" if what else f"{pip} -r requirements.txt -e . in this Python"


def _import_fix(name: str, error: str, facts: Facts) -> str:
    if "iJIT_NotifyEvent" in error:
        return ("mkl 2024.1+ breaks torch 1.13: " + ("conda install 'mkl<2024.1' (environment.yml pins it)"
                if facts.install in ("image", "conda") else "python -m pip install 'mkl<2024.1'"))
    if "libGL.so" in error:
        return "install opencv-python-headless instead of opencv-python (it needs no libGL)"
    if "numpy" in error.lower():
        return "NumPy and torch disagree: pip install 'numpy<2' (see requirements.txt)"
    return f"reinstall {name}: {reinstall(facts)}"


def _version_checks(facts: Facts) -> list[Check]:
    out = []
    where = facts.env_file or "the profile's env file"
    for name in PACKAGES:
        version = facts.versions.get(name)
        error = facts.import_errors.get(name)
        severity = "fail" if name in _ESSENTIAL else "warn"
        if error:
            out.append(Check(severity, name, f"import failed: {error}", _import_fix(name, error, facts)))
            continue
        if version is None:
            if name in ("cuda", "cudnn") and facts.versions.get("torch") is None:
                continue  # torch is missing: its row already says so
            if name == "cuda":
                continue  # a CPU build: the 'CUDA build' check says so
            out.append(Check(severity if name != "cudnn" else "info", name, "not installed",
                             f"install it from {where}" if name in facts.pins else ""))
            continue
        spec = facts.pins.get(name)
        if not spec:
            out.append(Check("ok", name, version))
            continue
        match = pin_matches(version, spec)
        if match is False and name in ("cuda", "cudnn"):
            out.append(_cuda_pin_check(facts, name, version, spec))
        elif match is False:
            out.append(Check("warn", name, f"{version}, but the profile pins {_shown_pin(spec)}",
                             f"not the env this profile builds: {reinstall(facts, name + _pip_spec(spec))}"))
        else:
            out.append(Check("ok" if match else "info", name, f"{version}  (pin {_shown_pin(spec)})"))
    torch_v, numpy_v = facts.versions.get("torch"), facts.versions.get("numpy")
    if torch_v and numpy_v and torch_v.split(".")[0] == "1" and int(numpy_v.split(".")[0]) >= 2:
        out.append(Check("fail", "numpy", f"NumPy {numpy_v} with torch {torch_v}: torch 1.x is built "
                         "against NumPy 1.x (torch.from_numpy fails)", "pip install 'numpy<2'"))
    if torch_v and torch_v.split(".")[0] == "1":  # a user's own script meets this before dlenv does
        out.append(Check("info", "scripts", f"PyTorch {torch_v.split('+')[0]}: a script written for 2.x stops with "
                         "AttributeError here (torch.compile, torch.accelerator: pytorch/examples' mnist)",
                         "run it on the modern profile (dlenv:cu128, PyTorch 2.x): docs/docker.md"))
    return out


def _has_gpu(facts: Facts) -> bool:
    return bool(facts.gpus or facts.smi_gpus or facts.driver or facts.driver_cuda)


def _cuda_pin_check(facts: Facts, name: str, version: str, spec: str) -> Check:
    """The CUDA (or cuDNN) torch was built with differs from the profile's. CUDA comes inside torch's
    wheel (or conda's pytorch-cuda), never as a package of its own, so the fix is another torch build:
    none is needed on a machine without a GPU, where CUDA is not used."""
    what = f"{version}, but the profile pins {_shown_pin(spec)}"
    if not _has_gpu(facts):
        return Check("info", name, f"{what}; no GPU here, so this torch's CUDA is not used")
    if facts.install in ("image", "conda"):
        return Check("warn", name, what, f"not the env this profile builds: {reinstall(facts)}")
    torch_v = (facts.versions.get("torch") or "").split("+")[0]
    cuda = (facts.pins.get("cuda") or "").strip("=.*").replace(".", "")
    return Check("warn", name, what, f"the profile's torch build: python -m pip install torch=={torch_v} "
                                     f"--index-url https://download.pytorch.org/whl/cu{cuda}")


def _driver_checks(facts: Facts, allow_cpu: bool) -> list[Check]:
    out = []
    if facts.versions.get("torch") and facts.torch_cuda is None:
        out.append(Check("warn" if allow_cpu else "fail", "CUDA build",
                         f"torch {facts.versions['torch']} is a CPU-only build",
                         _cpu_build_fix(facts, allow_cpu)))
    if facts.driver is None and facts.driver_cuda is None:
        out.append(Check("info", "driver", "no NVIDIA driver found (no nvidia-smi, no libcuda.so.1)"))
        return out
    detail = f"{facts.driver or 'version unknown'}" + (
        f" (runs CUDA up to {facts.driver_cuda})" if facts.driver_cuda else "")
    need = facts.torch_cuda
    if need and facts.driver_cuda:
        have_t = tuple(int(x) for x in facts.driver_cuda.split(".")[:2])
        need_t = tuple(int(x) for x in need.split(".")[:2])
        if have_t[0] < need_t[0]:
            return out + [Check("fail", "driver", f"{detail}; this PyTorch needs CUDA {need}",
                                f"update the NVIDIA driver to >= {MIN_DRIVER.get(need_t[0], 'a newer one')} "
                                f"(CUDA {need_t[0]}.x), or use an image built for an older CUDA")]
        if have_t < need_t:
            return out + [Check("warn", "driver", f"{detail}; this PyTorch is built for CUDA {need}",
                                "runs through CUDA minor version compatibility (no PTX JIT); a newer "
                                "driver is safer")]
    return out + [Check("ok" if need else "info", "driver", detail)]


def _cpu_build_fix(facts: Facts, allow_cpu: bool) -> str:
    """A CPU-only torch: fine on a CPU machine (--allow-cpu), else reinstall the CUDA build the way it came."""
    cpu_ok = "" if allow_cpu else "; on a machine without a GPU pass --allow-cpu (training runs on the CPU)"
    if facts.install in ("image", "conda"):
        return f"install the profile's CUDA build: {reinstall(facts)}{cpu_ok}"
    torch_v = (facts.versions.get("torch") or "1.13.1").split("+")[0]
    return (f"on a GPU machine: python -m pip install torch=={torch_v} --index-url "
            f"https://download.pytorch.org/whl/cu{(facts.pins.get('cuda') or '11.6').strip('=.*').replace('.', '')}"
            f"{cpu_ok}")


def _no_gpu_check(facts: Facts, allow_cpu: bool) -> Check:
    status = "warn" if allow_cpu else "fail"
    allow = "" if allow_cpu else ", or pass --allow-cpu to accept a machine without one"
    warning = facts.cuda_warning
    if warning and "driver" in warning.lower():
        return Check(status, "GPU", f"PyTorch found no usable GPU: {warning}",
                     f"update the NVIDIA driver (CUDA {facts.torch_cuda} needs >= "
                     f"{MIN_DRIVER.get(int((facts.torch_cuda or '12').split('.')[0]), 'a newer one')}){allow}")
    if facts.smi_gpus:
        return Check(status, "GPU", f"nvidia-smi lists {facts.smi_gpus} GPU(s) but PyTorch sees none"
                     + (f": {warning}" if warning else ""),
                     f"check CUDA_VISIBLE_DEVICES and that torch is a CUDA build{allow}")
    if allow_cpu and not facts.smi_gpus:  # a machine without a GPU, and the user said so: nothing to fix
        return Check(status, "GPU", "none: training runs on the CPU (without --model the demo takes its CPU recipe)")
    if facts.in_container and facts.install == "image":  # dlenv's image: the GPU comes with `docker run`
        return Check(status, "GPU", "no GPU visible in this container",
                     "run it with --gpus all (needs the NVIDIA Container Toolkit on the host)" + allow)
    return Check(status, "GPU", "no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False)",
                 "check nvidia-smi and the NVIDIA driver" + allow)


def _gpu_checks(facts: Facts) -> list[Check]:
    from dlenv.compat import arch_list_supports

    out = []
    torch_v = facts.versions.get("torch") or "?"
    for gpu in facts.gpus:
        sm = f"sm_{gpu.capability[0]}{gpu.capability[1]}"
        name = f"GPU {gpu.index}"
        detail = f"{gpu.name} · {_size(gpu.memory_bytes)} · {sm}"
        if not arch_list_supports(facts.arch_list, gpu.capability):
            built = " ".join(a for a in facts.arch_list if a.startswith("sm_")) or "no CUDA archs"
            out.append(Check("fail", name, f"{detail}: torch {torch_v} has no {sm} kernels (built for "
                             f"{built})", MODERN_FIX))
            continue
        out.append(Check("ok", name, detail))
        if not gpu.kernels:
            continue
        failed = [k for k in gpu.kernels if not k.passed]
        by_dtype: dict[str, float] = {}
        for k in gpu.kernels:
            if k.error is not None:
                by_dtype[k.dtype] = max(by_dtype.get(k.dtype, 0.0), k.error)
        errors = " · ".join(f"{d} {e:.0e}" for d, e in by_dtype.items())
        ops = "+".join(dict.fromkeys(k.op for k in gpu.kernels))
        if not failed:
            out.append(Check("ok", f"kernels {gpu.index}", f"{ops} fwd+bwd vs CPU fp32 · max rel. error "
                             f"{errors}"))
            out.append(_jpeg_check(facts, gpu))
            continue
        what = "; ".join(f"{k.op} {k.dtype}: " + (k.message or f"error {k.error:.1e} > {TOLERANCE[k.dtype]:.0e}")
                         for k in failed)
        fix = (MODERN_FIX if any("no kernel image" in k.message for k in failed)
               else "wrong results on this GPU: paste this screen into a bug report (driver or hardware?)")
        out.append(Check("fail", f"kernels {gpu.index}", what, fix))
    return out


def _jpeg_check(facts: Facts, gpu: Gpu) -> Check:
    """Where JPEGs can decode besides the CPU: the GPU's hardware engines through nvImageCodec, which
    `--decoder auto` takes with fewer than 8 CPU workers (docs/input-pipeline.md)."""
    name = f"jpeg {gpu.index}"
    if facts.nvimgcodec is None:
        return Check("info", name, "nvImageCodec not installed: JPEGs decode on the CPU (or nvJPEG)",
                     f"with few CPU cores per GPU, {facts.nvimgcodec_fix} lets GPUs with JPEG engines "
                     "decode them" if facts.nvimgcodec_fix else "")
    if gpu.jpeg_engines:
        return Check("ok", name, f"hardware JPEG engines (nvImageCodec {facts.nvimgcodec}): --decoder auto "
                     "uses them with fewer than 8 CPU workers")
    return Check("info", name, f"no hardware JPEG engines on this GPU (nvImageCodec {facts.nvimgcodec}): "
                 "JPEGs decode on the CPU (or nvJPEG with few cores)")


def _shm_check(facts: Facts) -> Check:
    if facts.shm_total is None:
        return Check("info", "/dev/shm", "none (not Linux); DataLoader workers don't need it here")
    free = facts.shm_free if facts.shm_free is not None else facts.shm_total
    need = facts.workers * facts.shm_per_worker
    who = f"{facts.workers} DataLoader worker{'s' if facts.workers != 1 else ''}" + (
        " (auto)" if facts.workers_auto else "")
    # what the trainer keeps (dlenv.data.workers.decide_workers): a number given is held to what fits too
    fit = workers_that_fit(facts.workers, facts.shm_total, free, facts.shm_per_worker, given=not facts.workers_auto)
    if facts.workers == 0 or (fit == facts.workers if facts.workers_auto else free >= need):
        return Check("ok", "/dev/shm", f"{_size(free)} free of {_size(facts.shm_total)} for {who}")
    if facts.workers_auto:
        why = (f"{who} need ~{_size(need)}" if free < need
               else f"one under {_size(SMALL_SHM)} is shared with everything else")
        what = f"{why}: auto drops to {fit} worker{'s' if fit != 1 else ''} (slower input)"
    else:
        what = (f"{who} need ~{_size(need)}: the trainer uses {fit} (slower input"
                f"{'; 0 loads in the main process' if fit == 0 else ''}) instead of dying with 'bus error'")
    return Check("warn", "/dev/shm", f"{_size(free)} free of {_size(facts.shm_total)}; {what}",
                 "start the container with --ipc=host (or --shm-size=8g)")


def checks(facts: Facts, allow_cpu: bool = False) -> list[Check]:
    """Judge the facts: one Check per line of the screen, in screen order."""
    out = _version_checks(facts)
    if "pins" in facts.import_errors:
        out.append(Check("warn", "pins", f"cannot read {facts.import_errors['pins']}"))
    out += _driver_checks(facts, allow_cpu)
    out += _gpu_checks(facts) if facts.gpus else [_no_gpu_check(facts, allow_cpu)]
    out.append(_shm_check(facts))
    low = facts.disk_free < 10 * 2**30
    out.append(Check("warn" if low else "ok", "disk", f"{_size(facts.disk_free)} free in {facts.disk_path}",
                     "free some space: datasets and run files need room" if low else ""))
    out.append(Check("info", "CPUs", f"{facts.cpus} usable" + (
        f" (of {facts.host_cpus} on the host: affinity or docker --cpus)"
        if facts.host_cpus != facts.cpus else "")))
    out += _requirements_check(facts) + _installed_check(facts)
    return out


#: a project's requirements.txt (dlenv.envcheck.projectreqs) -> the status of its line
_REQUIREMENTS = {"installed": "ok", "out-of-date": "warn", "failed": "warn"}


def _requirements_check(facts: Facts) -> list[Check]:
    """The workspace's requirements.txt: installed, out of date (changed since), or failed (a conflict with
    the profile's PyTorch, or pip's error); an info line outside the image; nothing without the file."""
    s = facts.requirements
    if s is None or not s.file:
        return []
    return [Check(_REQUIREMENTS.get(s.state, "info"), "requirements", s.detail, s.fix)]


def _installed_check(facts: Facts) -> list[Check]:
    """The working folder's requirements.txt held against this Python (dlenv.files.requirements): each
    requirement installed, missing or at another version; nothing without the file."""
    met = facts.requirements_met
    if met is None:
        return []
    if isinstance(met, str):
        return [Check("warn", "packages", met, "")]
    status, line, fix = requirements.summary([m if isinstance(m, requirements.Judged) else requirements.Judged(**m)
                                              for m in met])
    return [Check(status, "packages", line, fix)]


def verdict(facts: Facts, results: list[Check], allow_cpu: bool = False) -> tuple[bool, str]:
    """(ok, one line). ok when nothing failed; the line names the first failure and its fix."""
    failed = [c for c in results if c.status == "fail"]
    if failed:
        first = failed[0]
        more = f" (+{len(failed) - 1} more above)" if len(failed) > 1 else ""
        return False, f"FAIL: {first.name}: {first.detail}" + (f"; {first.fix}" if first.fix else "") + more
    if facts.gpus:
        names = ", ".join(dict.fromkeys(g.name for g in facts.gpus))
        n = len(facts.gpus)
        return True, f"PASS: ready to train on {n} GPU{'s' if n > 1 else ''} ({names})"
    return True, "PASS (--allow-cpu): no GPU, training runs on the CPU (slowly)"
