"""verify-env: can this environment train on a GPU? One screen to paste into a bug report.

Four steps, each a small function, so tests on a CPU can feed made-up facts (an sm_90 GPU with
PyTorch 1.13's arch list, a 64 MB /dev/shm) through the same checks a real run uses:

    collect()  -> Facts        versions, pins, driver, GPUs, real kernel runs, /dev/shm, disk, CPUs
    checks()   -> [Check]      each fact judged: ok / warn / fail / info, with a one-line fix
    verdict()  -> (ok, line)   ok only when nothing failed (a GPU is needed unless --allow-cpu)
    render_text() / render_json()

The kernel check runs conv2d and matmul, forward and backward, on each GPU in fp32, fp16 and (from
sm_80) bf16, and compares outputs and gradients with the same inputs computed in fp32 on the CPU.
torch is imported only inside collect(), so a broken torch install is itself reported as a fact.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlenv import __version__
from dlenv.cpus import usable_cpus

#: The source checkout (or /opt/dlenv in the image): where the profiles' env files live.
ROOT = Path(__file__).resolve().parents[2]
ENV_FILES = ("environment.yml", "environment.modern.yml")
MODERN_ENV_FILE = "environment.modern.yml"

#: Worst relative error allowed against the CPU fp32 reference, max|out - ref| / max|ref|, over the
#: output and both gradients. fp32 leaves room for TF32, which Ampere+ convolutions use by default
#: (10-bit mantissa); fp16 and bf16 round every output to 11 and 8 significant bits.
TOLERANCE = {"fp32": 5e-3, "fp16": 1e-2, "bf16": 4e-2}

#: Oldest Linux driver per CUDA major version (CUDA's minor version compatibility covers the rest).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

#: The trainer's default batch and image size, to size the /dev/shm the DataLoader workers need.
TRAIN_BATCH, TRAIN_IMG = 32, 224

# Packages on the screen, in order, and the name each has in requirements files / env files.
PACKAGES = ("dlenv", "python", "torch", "torchvision", "torchaudio", "cuda", "cudnn", "numpy", "opencv")
_PIN_NAMES = {"pytorch": "torch", "pytorch-cuda": "cuda", "opencv-python-headless": "opencv",
              "opencv-python": "opencv"}
# Without these, nothing trains; the others (torchaudio, OpenCV) only warn.
_ESSENTIAL = ("torch", "torchvision", "numpy")

MODERN_FIX = (f"build the modern profile (PyTorch 2.x with sm_90/sm_100/sm_120 kernels): "
              f"--build-arg ENV_FILE={MODERN_ENV_FILE}, see docs/docker.md")


# ---------------------------------------------------------------------------------------------------
# Facts


@dataclass
class Kernel:
    """One kernel check: `op` forward and backward in `dtype` on a GPU against the CPU fp32 result."""

    op: str
    dtype: str
    passed: bool
    error: float | None = None  # worst relative error; None when the op raised
    message: str = ""  # the exception's first line, when it raised


@dataclass
class Gpu:
    """One visible GPU as PyTorch sees it."""

    index: int
    name: str
    memory_bytes: int
    capability: tuple[int, int]
    kernels: list[Kernel] = field(default_factory=list)


@dataclass
class Facts:
    """Everything verify-env looks at; plain data, so tests can build one by hand."""

    versions: dict[str, str | None] = field(default_factory=dict)  # None: not installed
    import_errors: dict[str, str] = field(default_factory=dict)    # package -> first error line
    pins: dict[str, str] = field(default_factory=dict)             # package -> pip-style specifier
    env_file: str | None = None
    torch_cuda: str | None = None      # torch.version.cuda; None for a CPU-only build
    cuda_available: bool = False
    cuda_warning: str = ""             # what torch warned while looking for CUDA
    arch_list: list[str] = field(default_factory=list)
    driver: str | None = None          # e.g. 550.54.15
    driver_cuda: str | None = None     # newest CUDA the driver runs, e.g. 12.4
    smi_gpus: int = 0                  # GPUs nvidia-smi lists (may differ from what torch sees)
    gpus: list[Gpu] = field(default_factory=list)
    cpus: int = 1                      # usable: affinity mask and cgroup quota
    host_cpus: int = 1
    workers: int = 0                   # DataLoader workers the trainer would start
    workers_auto: bool = True
    shm_per_worker: int = 0            # bytes of batches in flight per worker
    shm_total: int | None = None       # /dev/shm size; None where there is none
    shm_free: int | None = None
    disk_path: str = "."
    disk_free: int = 0
    in_container: bool = False


def _first_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return text.strip().splitlines()[0] if text.strip() else ""


def cudnn_string(v: int | None) -> str | None:
    """torch.backends.cudnn.version() as text: 8302 -> '8.3.2', 90100 -> '9.1.0'."""
    if not v:
        return None
    if v >= 10000:  # cuDNN 9 encodes major * 10000 + minor * 100 + patch
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def cuda_string(v: int) -> str:
    """A CUDA version integer as the driver API reports it: 12040 -> '12.4'."""
    return f"{v // 1000}.{v % 1000 // 10}"


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,
    nounits` as dicts (index, name, memory_mib, driver); lines that don't parse are skipped."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        try:
            mem = int(float(parts[2]))
        except ValueError:
            mem = 0
        rows.append({"index": int(parts[0]), "name": parts[1], "memory_mib": mem, "driver": parts[3]})
    return rows


def _spec(conda_or_pip: str) -> tuple[str, str] | None:
    """'pytorch::pytorch=1.13.1' / 'numpy>=1.23,<2' / 'torch==2.1+cu128' -> (our name, pip specifier)."""
    s = conda_or_pip.split("#")[0].strip()
    if not s or s.startswith("-"):
        return None
    s = s.split("::")[-1].replace(" ", "")
    m = re.match(r"([A-Za-z0-9_.\-]+)(.*)", s)
    if not m:
        return None
    name, rest = m.group(1).lower().replace("_", "-"), m.group(2)
    name = _PIN_NAMES.get(name, name)
    if rest.startswith("=") and not rest.startswith("=="):  # conda: '=1.13.1[=build]' is a prefix match
        version = rest[1:].split("=")[0]
        rest = f"=={version}" if "*" in version else f"=={version}.*"
    return name, rest


def _read_requirements(path: Path, seen: set[Path]) -> list[str]:
    if path in seen or not path.is_file():
        return []
    seen.add(path)
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            lines += _read_requirements(path.parent / line.split(None, 1)[1], seen)
        elif line and not line.startswith("-"):
            lines.append(line)
    return lines


def read_pins(env_file: str | Path) -> dict[str, str]:
    """The pins of a conda env file and the requirements files it includes with `-r`.

    Returns {package: pip-style specifier}, with conda's prefix match written as '==1.13.1.*', the
    names we show ('torch', 'cuda', 'opencv'), and 'cuda' from pytorch-cuda=X or a torch '+cuXYZ'.
    Raises OSError or yaml.YAMLError for an unreadable file.
    """
    import yaml

    path = Path(env_file)
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries: list[str] = []
    for dep in data.get("dependencies", []):
        if isinstance(dep, dict):  # the pip: section
            for line in dep.get("pip", []):
                line = str(line).strip()
                if line.startswith(("-r ", "--requirement ")):
                    entries += _read_requirements(path.parent / line.split(None, 1)[1], set())
                else:
                    entries.append(line)
        else:
            entries.append(str(dep))
    pins: dict[str, str] = {}
    for entry in entries:
        parsed = _spec(entry)
        if parsed and parsed[1]:
            pins.setdefault(parsed[0], parsed[1])
    local = re.search(r"\+cu(\d+)(\d)$", pins.get("torch", ""))
    if local and "cuda" not in pins:
        pins["cuda"] = f"=={local.group(1)}.{local.group(2)}.*"
    return pins


def profile_name(pins: dict[str, str]) -> str | None:
    """'cu116' for a profile whose CUDA pin is 11.6; None without one."""
    m = re.match(r"==(\d+)\.(\d+)", pins.get("cuda", ""))
    return f"cu{m.group(1)}{m.group(2)}" if m else None


def pin_matches(installed: str, spec: str) -> bool | None:
    """Whether a version satisfies a pip-style specifier; None if it cannot be compared."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        version = Version(installed)
        spec_set = SpecifierSet(spec)
    except (InvalidSpecifier, InvalidVersion):
        return None
    if spec_set.contains(version, prereleases=True):
        return True
    # '==1.13.1.*' also accepts '1.13.1+cu116': compare the public version when the pin has no local part
    return "+" not in spec and spec_set.contains(Version(version.public), prereleases=True)


def find_env_file(torch_version: str | None) -> Path | None:
    """The env file of the profile this environment was built from.

    In the image DLENV_ENV_FILE names it. Elsewhere, the profile whose torch pin has the installed
    torch's major.minor; None when no profile matches (e.g. CI's 'newest' lane).
    """
    named = os.environ.get("DLENV_ENV_FILE")
    if named and Path(named).is_file():
        return Path(named)
    if not torch_version:
        return None
    mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    for name in ENV_FILES:
        path = ROOT / name
        try:
            spec = read_pins(path).get("torch", "")
        except Exception:  # a missing or broken env file just doesn't identify the profile
            continue
        if re.match(rf"==+{re.escape(mm)}\.", spec):
            return path
    return None


def _import_version(name: str) -> tuple[Any, str | None, str | None]:
    """(module, version, error line) of importing `name`; a failed import is a fact, not a crash."""
    import importlib

    module_name = {"opencv": "cv2"}.get(name, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None, None, None  # simply not installed
        return None, None, _first_line(e)
    except Exception as e:  # ImportError with an undefined symbol, OSError from a missing .so, ...
        return None, None, _first_line(e)
    return module, str(getattr(module, "__version__", "?")), None


def _loader_params() -> tuple[int, int]:
    """(batches each DataLoader worker prefetches, the most workers 'auto' picks), as the trainer uses."""
    try:
        from dlenv.data.loaders import MAX_AUTO_WORKERS, PREFETCH_FACTOR

        return PREFETCH_FACTOR, MAX_AUTO_WORKERS
    except Exception:  # without torch nothing trains anyway; use DataLoader's own default prefetch
        return 2, 8


def _driver() -> tuple[str | None, str | None, int]:
    """(driver version from nvidia-smi, newest CUDA it supports from libcuda, GPUs nvidia-smi lists)."""
    driver, rows = None, []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total,driver_version",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                 timeout=20).stdout
            rows = parse_nvidia_smi(out)
        except (OSError, subprocess.SubprocessError):
            rows = []
        driver = rows[0]["driver"] if rows else None
    driver_cuda = None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            driver_cuda = cuda_string(v.value)
    except (OSError, AttributeError):  # no driver library in this machine / container
        pass
    return driver, driver_cuda, len(rows)


def relative_error(out: Any, ref: Any) -> float:
    """max|out - ref| / max|ref| of two tensors (out cast to fp32 on the CPU); inf if out is not finite."""
    import torch

    out = out.detach().float().cpu()
    ref = ref.detach().float().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    scale = ref.abs().max().clamp_min(1e-12)
    return float((out - ref).abs().max() / scale)


def _cases() -> dict[str, tuple[tuple[int, ...], tuple[int, ...], Any]]:
    import torch.nn.functional as F

    return {
        "conv2d": ((8, 16, 32, 32), (32, 16, 3, 3), lambda x, w: F.conv2d(x, w, padding=1)),
        "matmul": ((256, 256), (256, 256), lambda a, b: a @ b),
    }


def kernel_check(device: str, op: str, dtype: str) -> Kernel:
    """Run `op` forward and backward on `device` in `dtype`; compare with fp32 on the CPU.

    The inputs are rounded to `dtype` first and the reference uses those same values, so the error
    measures the kernels, not the rounding of the inputs. Never raises for a failing kernel: the
    failure is the result.
    """
    import torch

    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    shape_a, shape_b, fn = _cases()[op]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(shape_a, generator=gen).to(dt)
    b = torch.randn(shape_b, generator=gen).to(dt)
    with torch.no_grad():
        out_shape = fn(a.float(), b.float()).shape
    grad = torch.randn(out_shape, generator=gen).to(dt)

    def run(dev: str, run_dtype: Any) -> list[Any]:
        x = a.to(dev, run_dtype).requires_grad_()
        y = b.to(dev, run_dtype).requires_grad_()
        out = fn(x, y)
        out.backward(grad.to(dev, run_dtype))
        return [out, x.grad, y.grad]

    try:
        got = run(device, dt)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        ref = run("cpu", torch.float32)
        error = max(relative_error(g, r) for g, r in zip(got, ref, strict=True))
    except Exception as e:  # 'no kernel image is available', cuBLAS/cuDNN failures, AcceleratorError...
        return Kernel(op, dtype, passed=False, message=_first_line(e))
    return Kernel(op, dtype, passed=error <= TOLERANCE[dtype], error=error)


def kernel_dtypes(capability: tuple[int, int]) -> list[str]:
    """The dtypes to check on a GPU: fp32 and fp16 everywhere, bf16 from sm_80 (Ampere) on."""
    return ["fp32", "fp16"] + (["bf16"] if capability >= (8, 0) else [])


def _collect_gpus(torch: Any, facts: Facts) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts.cuda_available = bool(torch.cuda.is_available())
        if facts.cuda_available:
            facts.arch_list = list(torch.cuda.get_arch_list())
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                facts.gpus.append(Gpu(i, p.name, int(p.total_memory), (p.major, p.minor)))
    facts.cuda_warning = next((_first_line(str(w.message)) for w in caught), "")
    from dlenv.compat import arch_list_supports

    for gpu in facts.gpus:
        if arch_list_supports(facts.arch_list, gpu.capability):  # else the checks say why, no kernels
            gpu.kernels = [kernel_check(f"cuda:{gpu.index}", op, dt)
                           for dt in kernel_dtypes(gpu.capability) for op in _cases()]


def collect(workers: int | str = "auto", workspace: str | Path | None = None) -> Facts:
    """Gather the facts of this machine: imports, versions, pins, driver, GPUs (running the kernel
    checks on each), /dev/shm, free disk in `workspace` (default: the current folder) and CPUs."""
    facts = Facts(versions={"dlenv": __version__, "python": platform.python_version()})
    modules = {}
    for name in ("torch", "torchvision", "torchaudio", "numpy", "opencv"):
        modules[name], facts.versions[name], err = _import_version(name)
        if err:
            facts.import_errors[name] = err
    torch = modules["torch"]
    if torch is not None:
        facts.torch_cuda = torch.version.cuda
        facts.versions["cuda"] = torch.version.cuda
        try:
            facts.versions["cudnn"] = cudnn_string(torch.backends.cudnn.version())
        except Exception:  # cuDNN missing or unloadable: reported as not found
            facts.versions["cudnn"] = None
    env_file = find_env_file(facts.versions.get("torch"))
    if env_file is not None:
        facts.env_file = str(env_file)
        try:
            facts.pins = read_pins(env_file)
        except Exception as e:  # a damaged env file is reported, not fatal
            facts.import_errors["pins"] = f"{env_file}: {_first_line(e)}"
    facts.driver, facts.driver_cuda, facts.smi_gpus = _driver()
    if torch is not None:
        _collect_gpus(torch, facts)
    facts.cpus, facts.host_cpus = usable_cpus(), os.cpu_count() or 1
    prefetch, max_auto = _loader_params()
    facts.workers_auto = workers == "auto"
    facts.workers = min(facts.cpus, max_auto) if facts.workers_auto else int(workers)
    facts.shm_per_worker = int(TRAIN_BATCH * 3 * TRAIN_IMG * TRAIN_IMG * 4 * prefetch * 1.5)
    try:
        shm = shutil.disk_usage("/dev/shm")
        facts.shm_total, facts.shm_free = shm.total, shm.free
    except OSError:  # not Linux: DataLoader workers don't use /dev/shm
        pass
    facts.disk_path = str(Path(workspace or os.getcwd()).resolve())
    facts.disk_free = shutil.disk_usage(facts.disk_path).free
    facts.in_container = Path("/.dockerenv").exists() or os.environ.get("DLENV_IMAGE") == "1"
    return facts


# ---------------------------------------------------------------------------------------------------
# Checks


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


def _shown_pin(spec: str) -> str:
    return spec[2:-2] if spec.startswith("==") and spec.endswith(".*") else spec


def _import_fix(name: str, error: str) -> str:
    if "iJIT_NotifyEvent" in error:
        return "mkl 2024.1+ breaks torch 1.13: conda install -n dl 'mkl<2024.1' (environment.yml pins it)"
    if "libGL.so" in error:
        return "install opencv-python-headless instead of opencv-python (it needs no libGL)"
    if "numpy" in error.lower():
        return "NumPy and torch disagree: pip install 'numpy<2' (see requirements.txt)"
    return f"reinstall {name} from the profile's env file, or rebuild the image"


def _version_checks(facts: Facts) -> list[Check]:
    out = []
    where = facts.env_file or "the profile's env file"
    for name in PACKAGES:
        version = facts.versions.get(name)
        error = facts.import_errors.get(name)
        severity = "fail" if name in _ESSENTIAL else "warn"
        if error:
            out.append(Check(severity, name, f"import failed: {error}", _import_fix(name, error)))
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
        if match is False:
            out.append(Check("warn", name, f"{version}, but the profile pins {_shown_pin(spec)}",
                             f"not the env this profile builds: rebuild the image, or conda env update "
                             f"-n dl -f {where}"))
        else:
            out.append(Check("ok" if match else "info", name, f"{version}  (pin {_shown_pin(spec)})"))
    torch_v, numpy_v = facts.versions.get("torch"), facts.versions.get("numpy")
    if torch_v and numpy_v and torch_v.split(".")[0] == "1" and int(numpy_v.split(".")[0]) >= 2:
        out.append(Check("fail", "numpy", f"NumPy {numpy_v} with torch {torch_v}: torch 1.x is built "
                         "against NumPy 1.x (torch.from_numpy fails)", "pip install 'numpy<2'"))
    return out


def _driver_checks(facts: Facts, allow_cpu: bool) -> list[Check]:
    out = []
    if facts.versions.get("torch") and facts.torch_cuda is None:
        out.append(Check("warn" if allow_cpu else "fail", "CUDA build",
                         f"torch {facts.versions['torch']} is a CPU-only build",
                         "install the CUDA build of the profile (the image's build refuses CPU builds)"))
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
    if facts.in_container:
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
            continue
        what = "; ".join(f"{k.op} {k.dtype}: " + (k.message or f"error {k.error:.1e} > {TOLERANCE[k.dtype]:.0e}")
                         for k in failed)
        fix = (MODERN_FIX if any("no kernel image" in k.message for k in failed)
               else "wrong results on this GPU: paste this screen into a bug report (driver or hardware?)")
        out.append(Check("fail", f"kernels {gpu.index}", what, fix))
    return out


def _shm_check(facts: Facts) -> Check:
    if facts.shm_total is None:
        return Check("info", "/dev/shm", "none (not Linux); DataLoader workers don't need it here")
    free = facts.shm_free if facts.shm_free is not None else facts.shm_total
    need = facts.workers * facts.shm_per_worker
    who = f"{facts.workers} DataLoader worker{'s' if facts.workers != 1 else ''}" + (
        " (auto)" if facts.workers_auto else "")
    if facts.workers == 0 or free >= need:
        return Check("ok", "/dev/shm", f"{_size(free)} free of {_size(facts.shm_total)} for {who}")
    fit = int(free // facts.shm_per_worker) if facts.shm_per_worker else 0
    if facts.shm_total < 1 << 30:
        fit = min(fit, 2)  # what the trainer's 'auto' leaves itself on a small /dev/shm
    effect = (f"auto drops to {fit} workers (slower input)" if facts.workers_auto
              else "workers die with 'bus error'")
    return Check("warn", "/dev/shm", f"{_size(free)} free of {_size(facts.shm_total)}; {who} need "
                 f"~{_size(need)}: {effect}",
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
                     "free some space: datasets and checkpoints need room" if low else ""))
    out.append(Check("info", "CPUs", f"{facts.cpus} usable" + (
        f" (of {facts.host_cpus} on the host: affinity or docker --cpus)"
        if facts.host_cpus != facts.cpus else "")))
    return out


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


# ---------------------------------------------------------------------------------------------------
# Rendering and the command


def render_text(facts: Facts, results: list[Check], line: str | None = None) -> str:
    """The screen: a header, one line per check (and its fix under it), then `line` if given."""
    profile = profile_name(facts.pins)
    where = f"profile {profile} ({facts.env_file})" if profile else "no image profile matches this torch"
    head = f"dlenv verify-env · {where}" + (" · in a container" if facts.in_container else "")
    rows = [head]
    for c in results:
        rows.append(f"{c.status:<5} {c.name:<12} {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            rows.append(f"{'':<5} {'':<12} -> {c.fix}")
    if line:
        rows.append(line)
    return "\n".join(rows)


def render_json(facts: Facts, results: list[Check], ok: bool, line: str) -> str:
    """Everything as JSON: ok, verdict, profile, the checks and the raw facts."""
    return json.dumps({"ok": ok, "verdict": line, "profile": profile_name(facts.pins),
                       "checks": [dataclasses.asdict(c) for c in results],
                       "facts": dataclasses.asdict(facts)}, indent=2)


def main(cfg: Any) -> int:
    """`dlenv verify-env` / `invoke verify-env`: print the screen (or JSON); 0 only if it can train.

    A failure also goes to stderr as one line, so `verify-env > report.txt` still shows why.
    """
    facts = collect(cfg.workers)
    results = checks(facts, cfg.allow_cpu)
    ok, line = verdict(facts, results, cfg.allow_cpu)
    if cfg.json:
        print(render_json(facts, results, ok, line))
    else:
        print(render_text(facts, results, line if ok else None))
    sys.stdout.flush()
    if not ok:
        print(f"verify-env: {line}", file=sys.stderr)
    return 0 if ok else 1
