"""Paths users give that are not plain files: nothing hangs, nothing reads without end.

A FIFO blocks `open()` until a writer comes (and SIGTERM's handler cannot run while the main thread
waits in the kernel), /dev/zero never ends, a YAML alias bomb expands to 10^9 values. Each row below
is one such input; every row that could hang runs as a subprocess under a timeout, and a process
still alive at the timeout is sent SIGTERM and must exit promptly (else the row fails as a hang).
Each asserts one line (what, where, what to do), the exit status of `dlenv.errors.EXIT_CODES`, no
traceback, no "bug in dlenv", and that the files given are unchanged.

- `--cfg`: FIFO, devices, folder, socket, links to them, an oversized file, alias bombs inside known
  options (`model_args:`, `epochs:`), merge keys, plain aliases, a file of a million values;
- a dataset holding FIFOs, devices and sockets named like images (left out at the scan, said once),
  and the same swapped in after the scan (every decoder opens without blocking: a bad image);
- `data-report` on such a dataset; the decoders one by one on each kind of special file.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from imagedata import make_image_folder

from dlenv.errors import EXIT_INPUT, EXIT_OK, UserError
from dlenv.options import cfgfile, config

ROOT = Path(__file__).resolve().parents[1]
#: seconds a row may take before it counts as hung (imports on a loaded 2-core machine take a few)
HANG_S = 60
#: seconds a hung process gets to exit after SIGTERM
TERM_S = 10


def run_bounded(argv: list[str], cwd: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """`python -m dlenv ARGV` in `cwd`; a process alive after `timeout` gets SIGTERM and must end
    within TERM_S (the row then fails as a hang either way)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "dlenv", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=TERM_S)
            pytest.fail(f"dlenv {' '.join(argv)} hung for {timeout} s (it did end on SIGTERM): {err[-2000:]}")
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"dlenv {' '.join(argv)} hung for {timeout} s and ignored SIGTERM: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error_line(verb: str, r: subprocess.CompletedProcess, expect: list[str], code: int = EXIT_INPUT) -> str:
    """Assert exit `code`, no traceback, one `dlenv VERB: error:` line, last, holding each of `expect`."""
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "bug in dlenv" not in text, text
    assert r.returncode == code, (r.returncode, text)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"dlenv {verb}: error:")]
    assert len(lines) == 1 and r.stderr.rstrip("\n").endswith(lines[0]), r.stderr
    for e in expect:
        assert e in lines[0], lines[0]
    return lines[0]


def digest(root: Path) -> dict[str, str]:
    """Every regular file under root -> its sha256; special files -> their kind (never opened)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
                                             else f"special {os.lstat(p).st_mode:o}")
    return out


def _bind_socket(path: Path) -> socket.socket:
    """A listening-ready UNIX socket at `path` (bound from its folder: a socket path holds 108 bytes)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        s.bind(path.name)
    finally:
        os.chdir(cwd)
    return s


# ---------------------------------------------------------------------------------------------------
# --cfg


_LAUGHS = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                    + [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=False)])

#: (id, how to make it in folder d -> the path given, what the line says)
CFG_CASES = [
    ("fifo", lambda d: _mkfifo(d / "c.yaml"), ["config file", "c.yaml", "named pipe (FIFO)", "regular file"]),
    ("fifo-no-suffix", lambda d: _mkfifo(d / "opts"), ["named pipe (FIFO)"]),
    ("link-to-fifo", lambda d: _link(d / "l.yaml", _mkfifo(d / "real.fifo")), ["l.yaml", "named pipe"]),
    ("dev-zero", lambda d: Path("/dev/zero"), ["/dev/zero", "character device", "regular file"]),
    ("dev-null", lambda d: Path("/dev/null"), ["/dev/null", "character device"]),
    ("dev-urandom", lambda d: Path("/dev/urandom"), ["/dev/urandom", "character device"]),
    ("link-to-dev-zero", lambda d: _link(d / "z.yaml", Path("/dev/zero")), ["z.yaml", "character device"]),
    ("folder", lambda d: d, ["is a folder", "e.g. runs/exp/config.yaml"]),
    ("socket", lambda d: _socket(d / "s.yaml"), ["s.yaml", "socket"]),
    ("too-big", lambda d: _write(d / "big.yaml", b"# " + b"x" * (2 << 20) + b"\nlr: 0.1\n"),
     ["big.yaml", "bytes, more than the 1,048,576"]),
    ("bomb-in-model-args", lambda d: _write(d / "b.yaml", (_LAUGHS + "\nmodel_args: *i\n").encode()),
     ["b.yaml", "line 2", "alias (*a)", "write each value out"]),
    ("bomb-in-epochs", lambda d: _write(d / "b.yaml", (_LAUGHS + "\nepochs: *i\n").encode()),
     ["b.yaml", "alias"]),
    ("bomb-flow-only", lambda d: _write(d / "b.yaml", b"epochs: [&x [1,1,1,1,1,1,1,1], [*x,*x,*x,*x,*x,*x]]\n"),
     ["b.yaml", "alias (*x)"]),
    ("alias-as-key", lambda d: _write(d / "b.yaml", b"a: &k lr\n*k : 0.1\n"), ["b.yaml", "alias (*k)"]),
    ("merge-key", lambda d: _write(d / "b.yaml", b"base: &b {lr: 0.1}\nmodel_args:\n  <<: *b\n"),
     ["b.yaml", "alias (*b)"]),
    ("plain-alias", lambda d: _write(d / "b.yaml", b"epochs: &e 3\nwarmup_epochs: *e\n"), ["line 2", "alias (*e)"]),
    ("million-values", lambda d: _write(d / "b.yaml", b"model_args: [" + b"1," * 400_000 + b"1]\n"),
     ["b.yaml", "more than 10,000 values"]),
    ("deep-nesting", lambda d: _write(d / "b.yaml", b"[" * 20000), ["b.yaml"]),
]


def _mkfifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _link(p: Path, target: Path) -> Path:
    p.symlink_to(target)
    return p


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def _socket(p: Path) -> Path:
    """A socket file at `p`. The path stays a socket after the socket object is closed, so it is closed at
    once (kept open, each one was an 'unclosed socket' ResourceWarning after `dlenv test`'s summary)."""
    _bind_socket(p).close()
    return p


@pytest.mark.parametrize(("make", "expect"), [c[1:] for c in CFG_CASES], ids=[c[0] for c in CFG_CASES])
def test_cfg_that_is_not_a_small_regular_yaml_file(tmp_path, make, expect):
    """In-process (config.build) under a watchdog thread, then through the CLI as a subprocess."""
    given = make(tmp_path)
    before = digest(tmp_path)
    result: dict = {}

    def build() -> None:
        try:
            config.build(config.TrainConfig, given)
        except UserError as e:
            result["error"] = str(e)
        except BaseException as e:  # noqa: BLE001 (reported below)
            result["other"] = repr(e)

    t = threading.Thread(target=build, daemon=True)
    tracemalloc.start()
    try:
        t.start()
        t.join(HANG_S)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not t.is_alive(), f"config.build({given}) hung"
    assert "other" not in result, result
    # counted in bytes, not seconds: at most 7 MiB (the million values), where reading on or expanding
    # an alias takes gigabytes
    assert peak < 64 * 2**20, f"refused, but only after holding {peak / 2**20:.0f} MiB"
    line = result["error"]
    assert "\n" not in line and all(e in line for e in expect), line
    r = run_bounded(["train", "--cfg", str(given), "--device", "cpu"], tmp_path)
    one_error_line("train", r, expect)
    assert digest(tmp_path) == before


def test_cfg_alias_refused_before_it_expands(tmp_path):
    """The bomb is refused at its first alias, holding about a MiB (an expansion would take minutes and
    gigabytes)."""
    y = _write(tmp_path / "b.yaml", (_LAUGHS + "\nmodel_args: *i\n").encode())
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="alias"):
            cfgfile.load_yaml(y)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_cfg_anchor_without_alias_and_dlenv_own_config_yaml_still_read(tmp_path):
    """An anchor alone expands nothing; config.yaml as dlenv writes it (yaml.safe_dump) reads back."""
    import yaml

    y = _write(tmp_path / "a.yaml", b"epochs: &e 3\n")
    assert config.build(config.TrainConfig, y).epochs == 3
    cfg = config.build(config.TrainConfig, epochs=2, model_args="width=8", workers=3)
    dumped = _write(tmp_path / "config.yaml", yaml.safe_dump(config.to_dict(cfg), sort_keys=False).encode())
    assert config.build(config.TrainConfig, dumped) == cfg


# ---------------------------------------------------------------------------------------------------
# A dataset holding special files


#: (id, how to put one special file named like an image into class folder d)
SPECIAL = [
    ("fifo-jpg", lambda d: _mkfifo(d / "x.jpg")),
    ("fifo-PNG", lambda d: _mkfifo(d / "Y.PNG")),
    ("link-to-dev-zero", lambda d: _link(d / "z.jpg", Path("/dev/zero"))),
    ("link-to-dev-urandom", lambda d: _link(d / "u.webp", Path("/dev/urandom"))),
    ("link-to-fifo", lambda d: _link(d / "l.jpeg", _mkfifo(d / ".hidden-fifo"))),
    ("socket-jpg", lambda d: _socket(d / "s.jpg")),
    ("fifo-in-subfolder", lambda d: _mkfifo(_mkdir(d / "deeper") / "f.bmp")),
]


def _mkdir(p: Path) -> Path:
    p.mkdir()
    return p


@pytest.fixture()
def special_ds(tmp_path, request):
    """ds/train/{cat,dog} and ds/val/{cat,dog} of real images, with the row's special file in
    train/cat/ and val/dog/."""
    ds = tmp_path / "ds"
    make_image_folder(ds / "train", per_class=6)
    make_image_folder(ds / "val", per_class=3, seed=1)
    make = request.param
    made = [make(ds / "train" / "cat"), make(ds / "val" / "dog")]
    return ds, made


@pytest.mark.parametrize("special_ds", [s[1] for s in SPECIAL], ids=[s[0] for s in SPECIAL], indirect=True)
def test_special_files_left_out_at_the_scan(special_ds, caplog):
    from dlenv.data.folder import find_layout

    ds, made = special_ds
    layout = find_layout(ds)
    listed = {p for p, _ in layout.train + layout.val}
    assert not listed & {str(m) for m in made}
    assert len(layout.train) == 12 and len(layout.val) == 6  # every real image is still there
    assert {Path(p).name for p in layout.special} == {m.name for m in made}
    warned = [r.getMessage() for r in caplog.records if "not a regular file" in r.getMessage()]
    assert len(warned) == 1 and "left out 2 entries" in warned[0] and "only regular files are read" in warned[0]


@pytest.mark.parametrize("special_ds", [s[1] for s in SPECIAL], ids=[s[0] for s in SPECIAL], indirect=True)
def test_data_report_on_special_files(special_ds):
    ds, _ = special_ds
    before = digest(ds)
    for extra in ([], ["--check-images"], ["--json"]):
        r = run_bounded(["data-report", str(ds), *extra], ds.parent)
        assert r.returncode == EXIT_OK and "Traceback" not in r.stderr, r.stderr
        assert "not a regular file" in r.stdout or "not_regular" in r.stdout, r.stdout
    assert digest(ds) == before


def _decoders():
    from dlenv.data import decode, plan, report, sources

    return [
        ("load_rgb", decode.load_rgb),
        ("decode_rgb-cv2", lambda p: decode.decode_rgb(p, "cv2", 32)),
        ("decode_rgb-tvio", lambda p: decode.decode_rgb(p, "tvio")),
        ("decode_stored-pil", lambda p: decode.decode_stored(p, 32, "pil")),
        ("decode_stored-cv2", lambda p: decode.decode_stored(p, 32, "cv2")),
        ("decode_stored-tvio", lambda p: decode.decode_stored(p, 32, "tvio")),
        ("nvjpeg-reader", sources._read),
        ("mean_pixels", lambda p: _raise_if(plan.mean_pixels([p]) != 0.0)),
        ("report-quick", lambda p: _raise_if(report._quick_check(p)[1] is None)),
        ("report-decode", lambda p: _raise_if(report.decode_problem(p) is None)),
    ]


def _raise_if(bad: bool) -> None:
    if bad:
        raise AssertionError("read a special file as if it were an image")
    raise UserError("refused")  # the helper reported the file as unreadable: a refusal


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-fifo", "socket", "dev-null"])
@pytest.mark.parametrize("decoder", [d[0] for d in _decoders()])
def test_every_decoder_refuses_a_special_file_without_blocking(tmp_path, kind, decoder):
    """The scan leaves them out; a file swapped for a FIFO after it (or a path from elsewhere) still
    never blocks a decoder: one fstat on the descriptor opened with O_NONBLOCK."""
    p = {"fifo": lambda: _mkfifo(tmp_path / "x.jpg"), "dev-zero": lambda: _link(tmp_path / "z.jpg", Path("/dev/zero")),
         "link-to-fifo": lambda: _link(tmp_path / "l.jpg", _mkfifo(tmp_path / "f")),
         "socket": lambda: _socket(tmp_path / "s.jpg"),
         "dev-null": lambda: _link(tmp_path / "n.jpg", Path("/dev/null"))}[kind]()
    fn = dict(_decoders())[decoder]
    result: dict = {}

    def call() -> None:
        try:
            fn(str(p))
            result["value"] = "returned"
        except UserError as e:
            result["error"] = str(e)
        except Exception as e:  # noqa: BLE001
            result["other"] = repr(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():  # unblock the thread so the test process can end, then fail
        with open(p, "wb", buffering=0) if kind in ("fifo", "link-to-fifo") else open(os.devnull, "wb"):
            pass
        pytest.fail(f"{decoder} blocked on a {kind}")
    assert "error" in result, result
    assert "\n" not in result["error"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bad_images", ["skip", "error"])
def test_a_fifo_swapped_in_after_the_scan_is_a_bad_image(tmp_path, workers, bad_images):
    """The classic loader with the FIFO among its samples (as after a race with the scan)."""
    from dlenv.data.badimages import BadImageError
    from dlenv.data.loaders import ImageDataset, build_transforms, make_loader

    make_image_folder(tmp_path / "ds", per_class=4)
    samples = [(str(p), 0) for p in sorted((tmp_path / "ds" / "cat").iterdir())]
    samples.insert(1, (str(_mkfifo(tmp_path / "ds" / "cat" / "swapped.jpg")), 0))
    ds = ImageDataset(samples, build_transforms(32, False), bad_images)
    loader = make_loader(ds, 2, workers, False, False)
    result: dict = {}

    def run() -> None:
        try:
            result["batches"] = sum(1 for _ in loader)
        except BadImageError as e:
            result["error"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "the loader blocked on a FIFO"
    if bad_images == "skip":
        assert result["batches"] == 3 and "swapped.jpg" in " ".join(loader.bad_paths)
        assert "named pipe" in loader.bad_paths[samples[1][0]]
    else:
        assert "swapped.jpg" in result["error"] and "named pipe (FIFO)" in result["error"]


@pytest.mark.slow
@pytest.mark.parametrize("special_ds", [SPECIAL[0][1], SPECIAL[2][1]], ids=["fifo", "dev-zero"], indirect=True)
@pytest.mark.parametrize("workers", ["0", "2"])
def test_train_on_a_dataset_with_a_fifo_finishes(special_ds, workers):
    """The issue's case end to end: training blocked in open() on the FIFO and SIGTERM then hung."""
    ds, made = special_ds
    before = digest(ds)
    r = run_bounded(["train", "--data", str(ds), "--img-size", "32", "--device", "cpu", "--workers", workers,
                     "--epochs", "1", "--batch-size", "4", "--model", "resnet18", "--project",
                     str(ds.parent / "runs")], ds.parent, timeout=240)
    assert r.returncode == EXIT_OK and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (r.stdout + r.stderr).count("not a regular file") == 1, r.stderr
    assert digest(ds) == before


@pytest.mark.slow
def test_sigterm_ends_a_run_whose_dataset_holds_a_fifo(tmp_path):
    """SIGTERM while the trainer works on a dataset with a FIFO: it ends promptly (143, or 0 if done)."""
    ds = tmp_path / "ds"
    make_image_folder(ds / "train", per_class=40)
    make_image_folder(ds / "val", per_class=4, seed=1)
    _mkfifo(ds / "train" / "cat" / "a.jpg")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "dlenv", "train", "--data", str(ds), "--img-size", "32",
                             "--device", "cpu", "--workers", "0", "--epochs", "50", "--batch-size", "4",
                             "--model", "resnet18", "--project", str(tmp_path / "runs")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((tmp_path / "runs").glob("*/results.csv")):
        time.sleep(0.5)  # one epoch done: the run is past every file of the dataset
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not end within 60 s of SIGTERM")
    assert proc.returncode in (0, 143), err[-3000:]
    assert "Traceback" not in err
