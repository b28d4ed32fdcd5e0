"""The facts verify-env judges, gathered once: versions, pins, driver, GPUs (with real kernel runs),
/dev/shm, disk, CPUs and the project's requirements.txt. Plain data (`Facts`), so tests on a CPU can build
one by hand; torch is imported only inside `collect()`, so a broken install is itself a fact."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlenv import __version__
from dlenv.envcheck.kernels import Kernel
from dlenv.errors import UserError, first_line
from dlenv.files import requirements
from dlenv.options.cpus import auto_workers, usable_cpus

#: The trainer's default batch and image size, to size the /dev/shm the DataLoader workers need.
TRAIN_BATCH, TRAIN_IMG = 32, 224


@dataclass
class Gpu:
    """One visible GPU as PyTorch sees it."""

    index: int
    name: str
    memory_bytes: int
    capability: tuple[int, int]
    kernels: list[Kernel] = field(default_factory=list)
    jpeg_engines: bool | None = None  # nvImageCodec's hardware backend decodes here; None: not checked


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
    install: str = "image"             # how dlenv was installed: image, conda, venv or pip (install_kind)
    nvimgcodec: str | None = None      # nvImageCodec's version, where it loads (GPU JPEG decoding)
    nvimgcodec_fix: str = ""           # where it does not: what to install
    requirements: Any = None           # projectreqs.Status: the workspace's requirements.txt, as the image installs it
    requirements_met: Any = None       # files.requirements.judged: the working folder's, against this Python
                                       # (None: no file; a str: why it could not be read)


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
        return None, None, first_line(e)
    except Exception as e:  # ImportError with an undefined symbol, OSError from a missing .so, ...
        return None, None, first_line(e)
    return module, str(getattr(module, "__version__", "?")), None


def _shm_per_worker(gpu: bool) -> int:
    """The /dev/shm bytes each DataLoader worker's batches in flight take, as the trainer sizes them
    for its default batch and size: with a GPU its workers ship uint8 stored squares (the device path,
    the default there), without one float32 crops."""
    try:
        from dlenv.data.workers import shipped_bytes, shm_per_worker
    except Exception:  # without torch nothing trains (that is reported): nothing to size /dev/shm for
        return 0
    return shm_per_worker(TRAIN_BATCH, shipped_bytes(TRAIN_IMG, gpu))


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


def _collect_gpus(torch: Any, facts: Facts) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts.cuda_available = bool(torch.cuda.is_available())
        if facts.cuda_available:
            facts.arch_list = list(torch.cuda.get_arch_list())
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                facts.gpus.append(Gpu(i, p.name, int(p.total_memory), (p.major, p.minor)))
    facts.cuda_warning = next((first_line(str(w.message)) for w in caught), "")
    from dlenv.compat import arch_list_supports
    from dlenv.envcheck.kernels import cases, kernel_check, kernel_dtypes

    for gpu in facts.gpus:
        if arch_list_supports(facts.arch_list, gpu.capability):  # else the checks say why, no kernels
            gpu.kernels = [kernel_check(f"cuda:{gpu.index}", op, dt)
                           for dt in kernel_dtypes(gpu.capability) for op in cases()]
    if facts.gpus:
        _collect_jpeg_engines(torch, facts)


def _collect_jpeg_engines(torch: Any, facts: Facts) -> None:
    """nvImageCodec's version and, per GPU, whether its hardware JPEG engines decode (dlenv.data.hwdecode)."""
    from dlenv.data import hwdecode

    mod, why = hwdecode.module()
    if mod is None:
        facts.nvimgcodec_fix = f"pip install {hwdecode.wheel_name()}"
        return
    facts.nvimgcodec = str(getattr(mod, "__version__", "?"))
    for gpu in facts.gpus:
        if gpu.kernels and all(k.passed for k in gpu.kernels):  # a GPU torch cannot use is not asked
            gpu.jpeg_engines = hwdecode.has_engines(torch.device("cuda", gpu.index))


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
    from dlenv.envcheck.pins import find_env_file, read_pins

    env_file = find_env_file(facts.versions.get("torch"))
    if env_file is not None:
        facts.env_file = str(env_file)
        try:
            facts.pins = read_pins(env_file)
        except Exception as e:  # a damaged env file is reported, not fatal
            facts.import_errors["pins"] = f"{env_file}: {first_line(e)}"
    facts.driver, facts.driver_cuda, facts.smi_gpus = _driver()
    if torch is not None:
        _collect_gpus(torch, facts)
    facts.cpus, facts.host_cpus = usable_cpus(), os.cpu_count() or 1
    facts.shm_per_worker = _shm_per_worker(bool(facts.gpus))
    facts.workers_auto = workers == "auto"
    facts.workers = auto_workers(facts.cpus) if facts.workers_auto else int(workers)
    try:
        shm = shutil.disk_usage("/dev/shm")
        facts.shm_total, facts.shm_free = shm.total, shm.free
    except OSError:  # not Linux: DataLoader workers don't use /dev/shm
        pass
    facts.disk_path = str(Path(workspace or os.getcwd()).resolve())
    facts.disk_free = shutil.disk_usage(facts.disk_path).free
    facts.in_container = Path("/.dockerenv").exists() or os.environ.get("DLENV_IMAGE") == "1"
    facts.install = install_kind(os.environ, sys.prefix, sys.base_prefix)
    # (imported here: `python -m dlenv.envcheck.projectreqs` must not find itself imported by its package)
    from dlenv.envcheck.projectreqs import status

    facts.requirements = status()
    try:
        facts.requirements_met = requirements.judged()
    except UserError as e:  # not a small text file: said, not fatal
        facts.requirements_met = str(e)
    return facts


def install_kind(environ: Any, prefix: str, base_prefix: str) -> str:
    """How this Python was set up, so advice names a fix the user can run: "image" (dlenv's image sets
    DLENV_IMAGE=1), "conda" (a conda env: CONDA_PREFIX is this interpreter's prefix, or it has
    conda-meta/), "venv" (a virtual environment), else "pip" (packages in a system or user Python)."""
    if environ.get("DLENV_IMAGE") == "1":
        return "image"
    if (environ.get("CONDA_PREFIX") and Path(environ["CONDA_PREFIX"]).resolve() == Path(prefix).resolve()) or \
            (Path(prefix) / "conda-meta").is_dir():
        return "conda"
    if prefix != base_prefix:
        return "venv"
    return "pip"
