"""dlenv.files.safeio: only regular files on a disk are opened (issue 52 item 5). A file of the kernel's own
file systems passes S_ISREG with a size that says nothing (/proc/self/mem's reads fail and were blamed on the
disk; /proc/self/environ is this process's secrets): it is judged by the file system its descriptor lies on,
so a link to one, under any name, is refused in the same line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv.errors import EXIT_INPUT, UserError
from dlenv.files import safeio


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "f.pth")
    return d / "f.pth"


def _link(d: Path, target: str, name: str = "last.pth") -> Path:
    (d / name).symlink_to(target)
    return d / name


def _first(*paths: str) -> str:
    """The first of `paths` this machine has (kernels differ in what /sys shows)."""
    found = next((p for p in paths if os.path.isfile(p)), None)
    if found is None:
        pytest.skip(f"none of {paths} here")
    return found


#: (id, the path given, made in folder d, what the line says)
NOT_ON_DISK = [
    ("link-to-proc-self-mem", lambda d: _link(d, "/proc/self/mem"), "kernel's proc file system"),
    ("proc-self-environ", lambda d: Path("/proc/self/environ"), "kernel's proc file system"),
    ("proc-self-status", lambda d: Path("/proc/self/status"), "kernel's proc file system"),
    ("proc-cpuinfo", lambda d: Path("/proc/cpuinfo"), "kernel's proc file system"),
    ("link-to-proc-kcore-ish", lambda d: _link(d, "/proc/self/cmdline", "best_model.pth"), "proc file system"),
    ("link-through-proc-self-root", lambda d: _link(d, "/proc/self/root/proc/self/environ"), "proc file system"),
    ("sys-kernel", lambda d: Path(_first("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/uevent_seqnum",
                                         "/sys/kernel/profiling")), "kernel's sysfs file system"),
    ("sys-devices-cpu", lambda d: _link(d, _first("/sys/devices/system/cpu/online", "/sys/devices/system/cpu/present")),
     "sysfs file system"),
    ("dev-zero", lambda d: Path("/dev/zero"), "a character device"),
    ("link-to-dev-urandom", lambda d: _link(d, "/dev/urandom"), "a character device"),
    ("fifo", _fifo, "a named pipe (FIFO)"),
    ("folder", lambda d: d, "is a folder"),
]


@pytest.mark.parametrize(("make", "said"), [c[1:] for c in NOT_ON_DISK], ids=[c[0] for c in NOT_ON_DISK])
def test_only_a_regular_file_on_a_disk_is_opened(tmp_path, make, said):
    path = make(tmp_path)
    with pytest.raises(UserError) as got:
        safeio.open_regular(path, "weights file").close()
    line = str(got.value)
    assert said in line and str(path) in line and "pass a regular file" in line and "\n" not in line, line
    assert not safeio.is_regular(path)
    assert (safeio.irregular(path) or "").rstrip(")") in line


@pytest.mark.parametrize("where", ["tmp", "dev-shm"])
def test_a_regular_file_on_a_disk_or_tmpfs_is_read(tmp_path, where):
    folder = Path("/dev/shm") if where == "dev-shm" and os.path.isdir("/dev/shm") else tmp_path
    path = folder / f"dlenv-safeio-{os.getpid()}.bin"
    path.write_bytes(b"weights")
    try:
        assert safeio.is_regular(path) and safeio.irregular(path) is None
        assert safeio.read_regular(path, 100) == b"weights"
        link = tmp_path / "link.pth"
        link.symlink_to(path)
        assert safeio.read_regular(link, 100) == b"weights"
    finally:
        path.unlink()


MOUNTINFO = "\n".join([
    "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw",
    "23 1 0:22 / /sys rw,nosuid - sysfs sysfs rw",
    "24 1 0:6 / /dev rw master:2 unbindable - devtmpfs udev rw,size=10k",
    "25 24 0:23 / /dev/shm rw - tmpfs tmpfs rw",
    "26 1 254:0 / / rw - ext4 /dev/vda1 rw",
    "27 23 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu",
    r"28 1 0:40 / /mnt/with\040space rw - fuse.sshfs host:/x rw",
    "29 22 0:41 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw",
    "30 1 0:42 / /odd - - rw",                       # a damaged line: no type after '-'
    "31 1 x:y / /bad rw - proc proc rw",            # not numbers
    "short line",
])


def test_the_kernel_mounts_are_read_from_mountinfo():
    found = safeio.kernel_mounts(MOUNTINFO)
    assert found == {os.makedev(0, 21): "proc", os.makedev(0, 22): "sysfs", os.makedev(0, 6): "devtmpfs",
                     os.makedev(0, 29): "cgroup", os.makedev(0, 41): "binfmt_misc"}


def test_this_process_knows_its_proc_mount():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    assert safeio.pseudo_devices().get(os.stat("/proc/self/status").st_dev) == "proc"


@pytest.mark.parametrize("target", ["/proc/self/mem", "/proc/self/environ"])
def test_val_on_a_run_file_linked_into_the_kernel_is_one_input_line(tmp_path, target):
    """`dlenv val --weights runs/exp/last.pth` with last.pth -> /proc/self/mem: exit 2, the file named, not a
    disk fault (exit 5)."""
    run = tmp_path / "runs" / "exp"
    run.mkdir(parents=True)
    (run / "last.pth").symlink_to(target)
    r = subprocess.run([sys.executable, "-m", "dlenv", "val", "--weights", str(run / "last.pth"), "--device", "cpu"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_INPUT, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "last.pth" in r.stderr and "regular file" in r.stderr and "disk" not in r.stderr.replace(
        "not one on a disk", ""), r.stderr
