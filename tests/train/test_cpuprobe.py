"""--amp on a CPU: bf16 only where it was measured faster (dlenv.train.auto.decide_precision), never a slower
run; the verdict is measured once per machine and kept (dlenv.train.cpuprobe).

The measurement is a stub that counts its calls: a kept verdict means no call. A cache that is missing,
damaged, hostile or unwritable only means measuring again, never an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dlenv.train import cpuprobe
from dlenv.train.auto import decide_precision
from dlenv.train.cpuprobe import cpu_amp_cache


class Stub:
    """step_seconds for decide_precision: fp32 takes 1 s, bf16 `ratio` s; counts the calls."""

    def __init__(self, ratio: float):
        self.ratio, self.calls = ratio, 0

    def __call__(self, mode: str) -> float:
        self.calls += 1
        return {"fp32": 1.0, "bf16": self.ratio}[mode]


def decide(cache, stub, what="small_cnn 32px"):
    return decide_precision(True, "auto", "cpu", stub, cache=cache, what=what)


@pytest.mark.parametrize("ratio,mode", [(3.0, "fp32"), (0.5, "bf16")])
def test_the_verdict_is_measured_once_and_kept(tmp_path, ratio, mode):
    cache = tmp_path / "dlenv" / "cpu-amp.json"
    stub = Stub(ratio)
    first = decide(cache, stub)
    assert first[0] == mode and stub.calls == 2 and "(measured" in first[1]
    for _ in range(3):
        again = decide(cache, stub)
        assert again[0] == mode and f"{ratio:.2f}x" in again[1] and f"kept in {cache}" in again[1]
    assert stub.calls == 2  # measured at the first start only
    assert json.loads(cache.read_text())["version"] == 1


@pytest.mark.parametrize("change", ["cpu", "torch", "threads", "what"])
def test_another_cpu_torch_thread_count_or_model_is_measured_again(tmp_path, monkeypatch, change):
    cache = tmp_path / "cpu-amp.json"
    stub = Stub(3.0)
    decide(cache, stub)
    what = "small_cnn 32px"
    if change == "cpu":
        monkeypatch.setattr(cpuprobe, "_cpu_name", lambda: "Another CPU @ 1.00GHz")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "9.9.9")
    elif change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 7)
    else:
        what = "resnet18 224px"
    decide(cache, Stub(0.5), what)
    assert decide(cache, stub, what)[0] == "bf16" and stub.calls == 2  # the new key's verdict, kept
    monkeypatch.undo()
    assert decide(cache, stub)[0] == "fp32" and stub.calls == 2  # the first key's verdict is still there


def _entry(ratio) -> str:
    return json.dumps({"version": 1, "verdicts": {cpuprobe.machine_key("small_cnn 32px"): {"bf16_over_fp32": ratio}}})


@pytest.mark.parametrize("content", [
    b"", b"not json", b"\xff\xfe\x00", b"[]", b"null", b'{"version": 2, "verdicts": {}}',
    b'{"version": 1, "verdicts": []}',
    _entry("0.5").encode(), _entry(True).encode(), _entry(None).encode(), _entry([0.5]).encode(),
    _entry(0).encode(), _entry(-1).encode(), _entry(1e300).encode(),
    _entry(float("nan")).encode(), _entry(float("inf")).encode(),  # json.dumps writes NaN and Infinity
    b'{"version": 1, "verdicts": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",  # past the size bound
], ids=["empty", "text", "bytes", "list", "null", "version", "verdicts-list", "ratio-str", "ratio-bool",
        "ratio-null", "ratio-list", "zero", "negative", "huge", "nan", "inf", "too-big"])
def test_a_damaged_cache_means_measuring_again(tmp_path, content):
    cache = tmp_path / "cpu-amp.json"
    cache.write_bytes(content)
    stub = Stub(3.0)
    assert decide(cache, stub)[0] == "fp32" and stub.calls == 2
    assert decide(cache, stub)[0] == "fp32" and stub.calls == 2  # rewritten whole: kept from now on
    assert cpuprobe._ratio_of(json.loads(cache.read_text())["verdicts"][cpuprobe.machine_key("small_cnn 32px")])


@pytest.mark.parametrize("kind,second", [
    ("folder", 4), ("parent-is-a-file", 4), ("read-only-folder", 4),  # never written: every start measures
    ("fifo", 2), ("symlink-loop", 2),  # read without blocking or following, refused; replaced by the file
])
def test_a_cache_that_cannot_be_read_or_written_is_no_error(tmp_path, kind, second):
    cache = tmp_path / "c" / "cpu-amp.json"
    cache.parent.mkdir()
    if kind == "folder":
        cache.mkdir()
    elif kind == "fifo":
        os.mkfifo(cache)
    elif kind == "parent-is-a-file":
        cache.parent.rmdir()
        cache.parent.write_text("x")
    elif kind == "read-only-folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        cache.parent.chmod(0o500)
    else:
        cache.symlink_to(cache)
    stub = Stub(0.5)
    try:
        for calls in (2, second):
            assert decide(cache, stub)[0] == "bf16" and stub.calls == calls
    finally:
        if cache.parent.is_dir():
            cache.parent.chmod(0o700)


def test_a_failed_bf16_step_is_not_kept_and_no_cache_means_no_file(tmp_path):
    cache = tmp_path / "cpu-amp.json"

    def no_bf16(mode):
        if mode == "bf16":
            raise RuntimeError("\"slow_conv2d_cpu\" not implemented for 'BFloat16'")
        return 1.0

    assert decide(cache, no_bf16)[0] == "fp32" and not cache.exists()
    stub = Stub(0.5)
    for calls in (2, 4):  # without a cache every start measures, as before
        assert decide_precision(True, "auto", "cpu", stub)[0] == "bf16" and stub.calls == calls


def test_the_cache_keeps_only_the_newest_verdicts(tmp_path):
    cache = tmp_path / "cpu-amp.json"
    for i in range(cpuprobe._CACHE_ENTRIES + 10):
        decide(cache, Stub(0.5), what=f"model{i}")
    verdicts = json.loads(cache.read_text())["verdicts"]
    assert len(verdicts) == cpuprobe._CACHE_ENTRIES
    assert any(k.endswith("| model73") for k in verdicts) and not any(k.endswith("| model0") for k in verdicts)


@pytest.mark.parametrize("xdg,expected", [
    ("/somewhere/cache", "/somewhere/cache/dlenv/cpu-amp.json"),
    ("", "HOME/.cache/dlenv/cpu-amp.json"),
    ("relative/cache", "HOME/.cache/dlenv/cpu-amp.json"),  # the XDG spec: a relative path is ignored
])
def test_without_a_workspace_to_write_the_cache_lives_in_the_users_cache_folder(tmp_path, monkeypatch, xdg, expected):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    work = tmp_path / "work"
    (work / ".dlenv").parent.mkdir()
    (work / ".dlenv").write_text("a file where the folder would go")  # the workspace's place is taken
    monkeypatch.chdir(work)
    assert cpu_amp_cache() == Path(expected.replace("HOME", str(tmp_path)))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only working folder (--read-only)
    (work / ".dlenv").unlink()
    assert cpu_amp_cache() == Path(expected.replace("HOME", str(tmp_path)))


def test_the_verdict_is_kept_in_the_workspace_and_survives_a_new_container(tmp_path, monkeypatch):
    work = tmp_path / "workspace"
    work.mkdir()
    monkeypatch.chdir(work)
    stub = Stub(3.0)
    for home in ("home1", "home2"):  # a fresh container, or --user with HOME in /tmp: a new home each time
        monkeypatch.setenv("HOME", str(tmp_path / home))
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        assert cpu_amp_cache() == work / ".dlenv" / "cpu-amp.json"
        decide_precision(True, "auto", "cpu", stub, cache=cpu_amp_cache())
    assert stub.calls == 2  # measured once, in the first "container" only
    assert (work / ".dlenv" / "cpu-amp.json").is_file()


CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: X\nflags\t\t: fpu sse2 avx2 {extra}\n\n"


@pytest.mark.parametrize("text, native", [
    (CPUINFO.format(extra="avx512f avx512_bf16"), True),          # Cooper Lake, Zen 4
    (CPUINFO.format(extra="amx_bf16 amx_tile"), True),            # Sapphire Rapids
    (CPUINFO.format(extra="avx512f avx512bw"), False),            # Skylake-SP: bf16 emulated
    (CPUINFO.format(extra=""), False),
    ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),     # Arm (Graviton 3)
    ("processor\t: 0\nFeatures\t: fp asimd\n", False),             # Arm without BF16
    ("", None),                                                   # nothing to read: measure
])
def test_bf16_in_hardware_is_read_from_the_cpu_flags(text, native):
    assert cpuprobe.cpu_bf16_native(text) is native


def test_a_cpu_without_bf16_instructions_is_decided_without_timing(tmp_path):
    def never(mode):
        raise AssertionError("timed on a CPU whose flags already decided")

    mode, why = decide_precision(True, "auto", "cpu", never, cache=tmp_path / "c.json", native=False)
    assert mode == "fp32" and "no bfloat16 instructions" in why and "--amp-dtype bf16 forces bf16" in why
    assert not (tmp_path / "c.json").exists()
    assert decide_precision(True, "bf16", "cpu", never, native=False)[0] == "bf16"  # asked for by name


def test_the_probe_costs_about_a_second_not_the_models_steps():
    # images of 32x32 through a small fixed network
    assert cpuprobe._CPU_PROBE_BATCH * (cpuprobe._CPU_PROBE_STEPS + 1) <= 32


def test_the_cpu_name_is_a_line_of_text():
    name = cpuprobe._cpu_name()
    assert name and "\n" not in name and len(name) < 200


# ---------------------------------------------------------------------------------------------------
# The decision without a cache: bf16 only where it was measured faster, and only when there is a choice.


def test_cpu_amp_falls_back_to_fp32_where_bf16_is_slower():
    timed = []

    def slower_bf16(mode):
        timed.append(mode)
        return {"fp32": 1.0, "bf16": 3.0}[mode]

    mode, why = decide_precision(True, "auto", "cpu", slower_bf16)
    assert mode == "fp32" and timed == ["fp32", "bf16"]
    assert "3.00x the time" in why and "training in fp32" in why and "--amp-dtype bf16" in why
    mode, why = decide_precision(True, "auto", "cpu", lambda m: {"fp32": 2.0, "bf16": 1.0}[m])
    assert mode == "bf16" and "0.50x" in why


def test_cpu_amp_decision_measures_only_when_it_has_a_choice():
    def never(mode):
        raise AssertionError("measured without a choice to make")

    assert decide_precision(False, "auto", "cpu", never) == ("fp32", "no --amp")
    assert decide_precision(True, "bf16", "cpu", never)[0] == "bf16"  # asked for by name: kept


def test_cpu_probe_seconds_times_a_real_step_and_leaves_the_seed_alone():
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    for mode in ("fp32", "bf16"):
        assert cpuprobe.cpu_probe_seconds(mode) > 0
    assert torch.equal(torch.rand(1), expected)


def test_cpu_amp_falls_back_to_fp32_where_a_bf16_step_fails():
    def no_bf16_kernel(mode):
        if mode == "bf16":
            raise RuntimeError('"slow_conv3d_cpu" not implemented for \'BFloat16\'\nmore lines')
        return 1.0

    mode, why = decide_precision(True, "auto", "cpu", no_bf16_kernel)
    assert mode == "fp32" and "a bf16 step failed" in why and "BFloat16" in why and "\n" not in why
