"""dlenv.watch: the command run in its own group with its exit status and signals passed on, the record
written, the advice as a pure function of (synthetic) NVML samples, NVML read through a fake pynvml, the
no-GPU line, and `dlenv watch -- ...` on the command line."""

from __future__ import annotations

import csv
import dataclasses
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from dlenv import cli
from dlenv.errors import UserError
from dlenv.options import config
from dlenv.watch import advice, probes, record, run

GIB = 1024 ** 3


# ---------------------------------------------------------------------------------------------------
# The advice on synthetic sample series


def _series(utils, *, host_cpu=50.0, disk=0.0, mem=0.6, power=None, limit=700.0, clock=1980.0, max_clock=1980.0,
            total=80 * GIB):
    """Samples one second apart: GPU utilisation from `utils`, the rest constant (or a list per sample)."""
    def at(v, k):
        return v[k] if isinstance(v, list) else v

    out = []
    for k, u in enumerate(utils):
        p = at(power, k) if power is not None else 100 + 5.5 * u  # in line with utilisation
        out.append(probes.Sample(t=float(k + 1), host_cpu=at(host_cpu, k), proc_cpu=150.0, proc_rss=2 * GIB,
                                disk_read=at(disk, k) * advice.MIB, procs=5,
                                gpus=[probes.GpuSample(util=u, mem_used=at(mem, k) * total, mem_total=total, power=p,
                                                      power_limit=limit, sm_clock=at(clock, k),
                                                      sm_clock_max=max_clock)]))
    return out


GAPPY = [0, 0, 100, 10, 100, 5, 100, 0, 100, 20, 100, 100, 0, 0]  # start-up, then gaps every other second


@pytest.mark.parametrize("samples, keys", [
    (_series([0, 0, 97, 98, 99, 97, 98, 99, 97, 0]), []),                                   # busy, nothing stands out
    (_series([0] * 10), ["idle"]),                                                           # never a kernel
    (_series(GAPPY, host_cpu=[95.0] * 14), ["input-cpu"]),                                   # gaps, CPUs saturated
    (_series(GAPPY, host_cpu=40.0, disk=300.0), ["input-disk"]),                              # gaps, disk busy
    (_series(GAPPY, host_cpu=30.0), ["input-workers"]),                                       # gaps, CPU has room
    (_series([99] * 10, mem=0.95), ["memory"]),                                               # near the card
    (_series([99] * 10, power=200.0), ["small-kernels"]),                                     # full util, low power
    (_series([99] * 10, clock=1100.0), ["throttled"]),                                        # clocks held down
    (_series([99] * 10, mem=0.1), ["room"]),                                                  # busy, memory unused
    (_series(GAPPY, host_cpu=95.0, mem=0.97), ["input-cpu", "memory"]),                       # two at once
], ids=["busy", "idle", "input-cpu", "input-disk", "input-workers", "memory", "small-kernels", "throttled", "room",
        "two"])
def test_the_advice_names_the_pattern(samples, keys):
    got = advice.advise(samples, ["H200"])
    assert [a.key for a in got] == keys
    for a in got:  # each line names what addresses it, in dlenv and in an own loop
        assert "dlenv train:" in a.line() and "Your own loop:" in a.line()


def test_the_advice_lines_name_the_options_that_address_them():
    lines = {a.key: a.line() for a in advice.advise(_series(GAPPY, host_cpu=95.0, mem=0.97), ["GPU"])}
    assert "--cache on" in lines["input-cpu"] and "--decoder nvimgcodec" in lines["input-cpu"]
    assert "--amp" in lines["memory"] and "--checkpoint" in lines["memory"]
    workers = advice.advise(_series(GAPPY, host_cpu=30.0), ["GPU"])[0].line()
    assert "--workers N" in workers and "num_workers" in workers
    small = advice.advise(_series([99] * 10, power=200.0), ["GPU"])[0].line()
    assert "--compile" in small and "--batch-size" in small and "200 of 700 W" in small


def test_the_summary_counts_busy_time_and_the_memory_peak():
    samples = _series([0, 0, 100, 100, 50, 100, 0, 0], mem=[0.1, 0.1, 0.5, 0.6, 0.6, 0.6, 0.2, 0.1])
    (s,) = advice.summarize(samples, ["H200"])
    assert s.busy == pytest.approx(350 / 8) and s.busy_active == pytest.approx(350 / 4)
    assert s.mem_peak == pytest.approx(0.6 * 80 * GIB) and s.mem_total == 80 * GIB
    text = advice.paragraph([s], [], 8.0, host=advice.host_line(samples, 4))
    assert "was busy 44% of the 8 s (88% from its first kernel to its last)" in text
    assert "memory peaked at 48.0 of 80.0 GiB (60%)" in text and "1.5 of the 4 CPU core(s)" in text
    assert "Nothing stood out" in text


def test_the_same_samples_give_the_same_advice():
    s = _series(GAPPY, host_cpu=95.0)
    assert advice.advise(s, ["a"]) == advice.advise(list(s), ["a"])


# ---------------------------------------------------------------------------------------------------
# NVML through a fake pynvml, and without one


class _Util:
    def __init__(self, gpu):
        self.gpu, self.memory = gpu, 0


class _Mem:
    def __init__(self, used, total):
        self.used, self.total = used, total


def _fake_pynvml(monkeypatch, count=2, utils=(100, 30), fail_init=None):
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM = 1
    calls = {"shutdown": 0}

    def init():
        if fail_init:
            raise fail_init

    m.nvmlInit = init
    m.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetHandleByUUID = lambda u: int(u.rsplit("-", 1)[1])
    m.nvmlDeviceGetName = lambda h: f"Fake GPU {h}".encode()
    m.nvmlDeviceGetUtilizationRates = lambda h: _Util(utils[h])
    m.nvmlDeviceGetMemoryInfo = lambda h: _Mem((h + 1) * GIB, 80 * GIB)
    m.nvmlDeviceGetPowerUsage = lambda h: 350_000  # mW

    def not_supported(*a):
        raise RuntimeError("Not Supported")

    m.nvmlDeviceGetEnforcedPowerLimit = not_supported  # a board that does not report it: None, no crash
    m.nvmlDeviceGetClockInfo = lambda h, c: 1500
    m.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return calls


def test_nvml_samples_every_visible_gpu(monkeypatch):
    calls = _fake_pynvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nv, why = probes.Nvml.open()
    assert why == "" and nv.names == ["Fake GPU 0", "Fake GPU 1"]
    g0, g1 = nv.sample()
    assert (g0.util, g0.mem_used, g0.power, g0.power_limit, g0.sm_clock) == (100.0, GIB, 350.0, None, 1500.0)
    assert g1.util == 30.0
    nv.close()
    assert calls["shutdown"] == 1


@pytest.mark.parametrize("visible, count, expected", [
    (None, 3, [0, 1, 2]), ("1", 3, [1]), ("2,0", 3, [2, 0]), ("0,7,1", 3, [0]), ("", 3, []),
    ("GPU-abc-1", 3, ["GPU-abc-1"]), ("MIG-x", 2, []),
])
def test_the_gpus_a_cuda_program_sees(monkeypatch, visible, count, expected):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert probes.visible_indices(count) == expected


@pytest.mark.parametrize("setup, says", [
    (dict(fail_init=RuntimeError("NVML Shared Library Not Found")), "no NVIDIA GPU to watch (NVML: NVML Shared"),
    (dict(count=0), "no NVIDIA GPU to watch (NVML sees none"),
])
def test_no_gpu_is_one_line(monkeypatch, setup, says):
    _fake_pynvml(monkeypatch, **setup)
    nv, why = probes.Nvml.open()
    assert nv is None and why.startswith(says) and "\n" not in why


def test_no_pynvml_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    nv, why = probes.Nvml.open()
    assert nv is None and why == "no NVIDIA GPU to watch (NVML: nvidia-ml-py (pynvml) is not installed)"


def test_gpu_busy_averages_the_epochs_samples(monkeypatch):
    _fake_pynvml(monkeypatch, utils=(80, 20))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    busy = probes.GpuBusy(1, interval=0.01).start()  # cuda:1 is NVML's GPU 0 here
    deadline = time.monotonic() + 30
    while not busy._values and time.monotonic() < deadline:
        time.sleep(0.01)
    assert busy.stop() == pytest.approx(80.0)
    busy.close()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert probes.GpuBusy(0).start().stop() is None  # no NVML: no figure, no error


# ---------------------------------------------------------------------------------------------------
# Running a command


def _watch(tmp_path, code: str, **kw):
    out = tmp_path / "rec"
    out.mkdir()
    lines = []
    status = run.watch([sys.executable, "-c", code], out, interval=0.1, say=lines.append, **kw)
    return status, out, "\n".join(lines)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)


def test_a_command_that_exits_0_is_recorded(tmp_path, no_gpu):
    status, out, said = _watch(tmp_path, "import time; x = [0] * 10**6; time.sleep(0.6)")
    assert status == 0
    assert said.startswith("dlenv watch: no NVIDIA GPU to watch") and "recording the host only" in said
    with (out / "watch.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) >= 2 and rows[0].keys() >= {"t_s", "host_cpu_pct", "proc_cpu_pct", "proc_rss_mib"}
    assert max(float(r["proc_rss_mib"]) for r in rows) > 1  # the command's own process was seen
    md = (out / "watch.md").read_text()
    assert "ended with exit status 0" in md and "the host was recorded" in md
    assert (out / "watch.png").read_bytes()[:4] == b"\x89PNG"


def test_a_failing_command_passes_its_exit_status_on(tmp_path, no_gpu):
    status, out, said = _watch(tmp_path, "import sys, time; time.sleep(0.3); sys.exit(7)")
    assert status == 7 and "exit status 7" in said
    assert "exit status 7" in (out / "watch.md").read_text()


def test_the_gpu_paragraph_and_advice_with_fake_nvml(tmp_path, monkeypatch):
    _fake_pynvml(monkeypatch, count=1, utils=(100,))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    status, out, said = _watch(tmp_path, "import time; time.sleep(0.8)")
    assert status == 0 and "watching GPU 0 (Fake GPU 0)" in said
    assert "The GPU (Fake GPU 0) was busy 100%" in said and "memory peaked at 1.0 of 80.0 GiB" in said
    with (out / "watch.csv").open() as fh:
        row = next(csv.DictReader(fh))
    assert row["gpu0_util_pct"] == "100.0" and row["gpu0_power_w"] == "350.0" and row["gpu0_power_limit_w"] == ""


def test_a_command_not_found_is_one_line(tmp_path, no_gpu):
    with pytest.raises(UserError, match="'no-such-program-x' not found on PATH"):
        run.watch(["no-such-program-x"], tmp_path, say=lambda m: None)


CHILD = """
import os, signal, sys, time
def bye(signum, frame):
    open(os.environ["MARK"], "w").write(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("handles", [True, False], ids=["child-handles-it", "default-action"])
def test_sigterm_to_watch_reaches_the_command_and_143_comes_back(tmp_path, handles):
    env = dict(os.environ, MARK=str(tmp_path / "mark"), PYTHONUNBUFFERED="1")
    code = CHILD if handles else "print('ready', flush=True); import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-m", "dlenv", "watch", "--interval", "0.2", "--", sys.executable, "-c",
                             code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("dlenv watch:")  # the watcher is up
    assert proc.stdout.readline().strip() == "ready"           # and so is the command
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)  # a safety net: the command ends at once
    assert proc.returncode == 143, err
    if handles:
        assert (tmp_path / "mark").read_text() == str(int(signal.SIGTERM))  # the child got it, not a kill
    rec = tmp_path / "runs" / "watch" / "exp"
    assert "exit status 143" in (rec / "watch.md").read_text() and (rec / "watch.csv").is_file()
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize("argv, own, command", [
    (["watch", "--", "python", "train.py", "--epochs", "3"], ["watch"], ["python", "train.py", "--epochs", "3"]),
    (["watch", "--interval", "2", "--", "dlenv", "train", "--", "x"], ["watch", "--interval", "2"],
     ["dlenv", "train", "--", "x"]),
    (["train", "--epochs", "1"], ["train", "--epochs", "1"], None),
])
def test_the_command_is_everything_after_the_first_double_dash(argv, own, command):
    assert cli._watched(argv) == (own, command)


@pytest.mark.parametrize("value, expected", [
    ("python train.py --lr 0.1", ("python", "train.py", "--lr", "0.1")),
    ("python -c 'print(1)'", ("python", "-c", "print(1)")),
    (["a b", "c"], ("a b", "c")),
])
def test_the_run_option_takes_words_or_one_string(value, expected):
    assert config.build(config.WatchConfig, run=value).run == expected


@pytest.mark.parametrize("given, says", [
    (dict(run="python 'unclosed"), "--run"),
    (dict(interval="0"), "--interval"),
    (dict(name="a/b"), "--name"),
])
def test_bad_watch_options_are_one_line(given, says):
    with pytest.raises(UserError, match=says):
        config.build(config.WatchConfig, **given)


def test_no_command_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["watch"]) == 2
    assert "no command to watch; give it after --" in capsys.readouterr().err
    assert not Path("runs").exists()


def test_invoke_watch_runs_the_string_given_to_run(tmp_path, monkeypatch, no_gpu):
    from invoke import MockContext, Parser
    from invoke.exceptions import Exit

    from dlenv import tasks

    monkeypatch.chdir(tmp_path)
    code = f"{sys.executable} -c 'import sys; sys.exit(5)'"
    parsed = Parser(contexts=tasks.ns.to_contexts()).parse_argv(["watch", "--run", code, "--interval", "0.2"])
    with pytest.raises(Exit) as e:
        tasks.ns["watch"](MockContext(), **parsed[0].as_kwargs)
    assert e.value.code == 5  # the command's own status
    assert "exit status 5" in (tmp_path / "runs" / "watch" / "exp" / "watch.md").read_text()


def test_gpu_busy_gives_a_short_epoch_its_one_sample_and_tries_nvml_once(monkeypatch):
    _fake_pynvml(monkeypatch, count=1, utils=(60,))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    busy = probes.GpuBusy(0, interval=3600)  # the epoch ends long before the first tick
    assert busy.start().stop() == pytest.approx(60.0)
    busy.close()
    opened = []
    monkeypatch.setattr(probes.Nvml, "open", classmethod(lambda cls, visible=None: opened.append(1) or (None, "no")))
    idle = probes.GpuBusy(0)
    for _ in range(3):  # three epochs
        assert idle.start().stop() is None
    assert opened == [1]


# ---------------------------------------------------------------------------------------------------
# A record that cannot be written, a command that cannot start


ENDS_WITH_A_MARK = "import os, sys, time; time.sleep(0.6); open(os.environ['DONE'], 'w').write('x'); sys.exit(3)"


@pytest.mark.parametrize("full", [("watch.csv",), ("watch.csv", "watch.md", "watch.png")],
                         ids=["watch.csv", "every file"])
def test_a_record_on_a_full_disk_says_so_and_the_commands_status_comes_back(tmp_path, monkeypatch, no_gpu, full):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "watch.csv").symlink_to("/dev/full")  # every write: ENOSPC
    if "watch.md" in full:
        def no_space(path, *a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(run, "write_text", no_space)
        monkeypatch.setattr(run, "plot", no_space)
    monkeypatch.setenv("DONE", str(tmp_path / "done"))
    lines: list[str] = []
    status = run.watch([sys.executable, "-c", ENDS_WITH_A_MARK], out, interval=0.1, say=lines.append)
    assert status == 3 and (tmp_path / "done").is_file()  # the command ran to its end, its status is watch's
    failed = [ln for ln in lines if "cannot write" in ln]
    assert len(failed) == len(full), lines
    assert all(name in line for name, line in zip(full, failed, strict=True))
    assert "recording stopped" in failed[0] and "\n" not in failed[0]
    assert "exit status 3" in lines[-1]


def _not_executable(tmp_path: Path) -> str:
    p = tmp_path / "train.py"
    p.write_text("print('hi')\n")
    return str(p)


def _no_shebang(tmp_path: Path) -> str:
    p = tmp_path / "train.sh"
    p.write_text("echo hi\n")
    p.chmod(0o755)
    return str(p)


def _binary_garbage(tmp_path: Path) -> str:
    p = tmp_path / "model.bin"
    p.write_bytes(b"\x00\x01\x02 not an ELF")
    p.chmod(0o755)
    return str(p)


@pytest.mark.parametrize("make, code, says", [
    (lambda t: "no-such-program-x", 127, "not found on PATH"),
    (lambda t: str(t / "missing.py"), 127, "not found on PATH"),
    (_not_executable, 126, "permission denied; chmod +x"),
    (_no_shebang, 126, "not a program the system can run (a script without a #! line?)"),
    (_binary_garbage, 126, "not a program the system can run"),
    (lambda t: str(t), 126, "cannot be run"),
], ids=["not-on-path", "missing-file", "not-executable", "no-shebang", "garbage", "a-folder"])
def test_a_command_that_cannot_start_is_one_line_with_a_shells_status(tmp_path, monkeypatch, capsys, no_gpu,
                                                                       make, code, says):
    monkeypatch.chdir(tmp_path)
    command = make(tmp_path)
    assert cli.main(["watch", "--", command]) == code
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("gpus", [1, 0])
def test_watch_png_legends_sit_beside_the_panels_and_disk_reads_say_whole_machine(gpus):
    samples = _series([0, 90, 95, 10, 92], disk=[0, 50, 80, 0, 5])
    if not gpus:
        samples = [dataclasses.replace(s, gpus=[]) for s in samples]
    fig = record.figure(samples, ["H100"] * gpus, "watch: python train.py", n_cpus=4)
    fig.canvas.draw()
    panels = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(panels) == (3 if gpus else 1)
    for ax in panels:  # no legend box overlaps the area where the lines are drawn
        box, area = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert box.x0 >= area.x1, (ax.get_title(), box, area)
    host = [t.get_text() for t in panels[-1].get_legend().get_texts()]
    assert any("disk reads" in t and "whole machine" in t for t in host), host
    assert "machine" in fig.axes[-1].get_ylabel()
