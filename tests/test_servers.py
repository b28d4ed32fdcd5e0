"""dlenv.servers on a CPU: the command lines, environments and lines `dlenv lab` / `dlenv tensorboard` build,
the token printed once, the folders chosen, each refusal as one line, and a real TensorBoard answering and
stopping on SIGTERM. JupyterLab itself runs in the image: tests/test_servers_image.py and
tests/container/test_lab_and_tensorboard.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from dlenv import cli, servers
from dlenv.errors import UserError
from dlenv.options import config
from dlenv.options.server_options import LabConfig, TensorboardConfig

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "t0k3n" * 8


def lab_launch(environ: dict, *, euid: int = 1000, tmp: str = "/tmp", **options):
    cfg = config.build(LabConfig, **options)
    return servers.lab_launch(cfg, environ, python="/env/bin/python", prefix="/env", euid=euid, uid=1000, tmp=tmp,
                              make_token=lambda: TOKEN, hash_password=lambda pw: "argon2:hash-of-" + pw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# Where the servers listen and what they print


@pytest.mark.parametrize(("host", "environ", "bound"), [
    ("auto", {"DLENV_IMAGE": "1"}, "0.0.0.0"),  # the image: -p reaches only a container's own addresses
    ("auto", {}, "127.0.0.1"),                  # elsewhere: this machine only, an SSH tunnel from outside
    ("auto", {"DLENV_IMAGE": "0"}, "127.0.0.1"),
    ("127.0.0.1", {"DLENV_IMAGE": "1"}, "127.0.0.1"),
    ("::", {}, "::"),
])
def test_the_address_each_server_listens_on(host, environ, bound):
    assert servers.listen_host(config.build(LabConfig, host=host).host, environ) == bound
    assert f"--ServerApp.ip={bound}" in lab_launch(environ, host=host).argv
    tb = servers.tensorboard_launch(config.build(TensorboardConfig, host=host), environ, python="py")
    assert f"--host={bound}" in tb.argv


@pytest.mark.parametrize(("host", "url"), [
    ("0.0.0.0", "http://127.0.0.1:8888/lab"), ("127.0.0.1", "http://127.0.0.1:8888/lab"),
    ("::", "http://[::1]:8888/lab"), ("10.1.2.3", "http://10.1.2.3:8888/lab"),
])
def test_the_url_to_open(host, url):
    assert servers.open_url(host, 8888, "/lab") == url


@pytest.mark.parametrize(("value", "message"), [
    ("localhost", "expected auto or an IP address"), ("0.0.0.0:80", "expected auto or an IP address"),
    ("", "expected auto or an IP address"),
])
def test_a_bad_host_is_one_line(value, message):
    with pytest.raises(UserError, match=message):
        config.build(LabConfig, host=value)


@pytest.mark.parametrize("port", ["0", "65536", "-1", "http"])
def test_a_bad_port_is_one_line(port):
    for cls in (LabConfig, TensorboardConfig):
        with pytest.raises(UserError, match="--port"):
            config.build(cls, port=port)


def test_the_lab_command_line():
    launch = lab_launch({"DLENV_IMAGE": "1", "HOME": "/"}, root="/", euid=0)
    argv = launch.argv
    assert argv[0] == "/env/bin/python" and argv[1] == "-c" and argv[3:5] == ["jupyterlab", "--no-browser"]
    assert {"--ServerApp.port=8888", "--ServerApp.port_retries=0", "--ServerApp.root_dir=/",
            "--allow-root"} <= set(argv)
    # nothing that reaches the internet: no news, no update check, no PyPI listing of extensions
    assert {"--LabApp.news_url=", "--LabApp.extension_manager=readonly",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"} <= set(argv)
    assert "--allow-root" not in lab_launch({"HOME": "/"}, euid=1234).argv


def test_the_token_is_printed_once_and_stays_off_the_command_line():
    launch = lab_launch({"DLENV_IMAGE": "1", "HOME": "/", "MPLBACKEND": "Agg"})
    text = "\n".join(launch.lines)
    assert text.count(TOKEN) == 1, text
    assert f"http://127.0.0.1:8888/lab?token={TOKEN}" in text and "-p 8888:8888" in text and "ssh -N -L 8888" in text
    assert not any(TOKEN in a for a in launch.argv)  # `ps` and `docker top` show command lines
    assert launch.env["JUPYTER_TOKEN"] == TOKEN
    assert "MPLBACKEND" not in launch.env  # the image's Agg would keep notebook figures from showing


def test_a_token_of_the_users_is_used_and_not_printed():
    launch = lab_launch({"HOME": "/", "JUPYTER_TOKEN": "mine-secret"})
    text = "\n".join(launch.lines)
    assert "mine-secret" not in text and "?token=$JUPYTER_TOKEN" in text and "the token in JUPYTER_TOKEN" in text
    assert launch.env["JUPYTER_TOKEN"] == "mine-secret"


def test_a_password_from_the_environment_replaces_the_token():
    launch = lab_launch({"HOME": "/", "DLENV_LAB_PASSWORD": "hunter2"})
    assert "--PasswordIdentityProvider.hashed_password=argon2:hash-of-hunter2" in launch.argv
    assert "--IdentityProvider.token=" in launch.argv and "JUPYTER_TOKEN" not in launch.env
    text = "\n".join(launch.lines)
    assert "hunter2" not in text and "http://127.0.0.1:8888/lab (the password in DLENV_LAB_PASSWORD" in text


@pytest.mark.parametrize("var", ["JUPYTER_TOKEN", "DLENV_LAB_PASSWORD"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_token_or_password_is_refused(var, value):
    # Jupyter takes an empty token as "no authentication": anyone reaching the port would get a shell
    with pytest.raises(UserError, match=f"{var} is set but empty"):
        lab_launch({"HOME": "/", var: value})


# ---------------------------------------------------------------------------------------------------
# Jupyter's folders with --user and --read-only


def test_a_writable_home_keeps_jupyters_own_folders(tmp_path):
    launch = lab_launch({"HOME": str(tmp_path)}, tmp=str(tmp_path / "tmp"))
    assert not set(servers.JUPYTER_DIRS) & set(launch.env) and launch.folders == ()
    # a HOME that does not exist yet is made by Jupyter where its parent can be written
    assert servers.writable(tmp_path / "not" / "yet")


@pytest.mark.parametrize("home", ["unset", "empty", "a file", "under a file"])
def test_an_unwritable_home_sends_jupyters_folders_to_tmp(tmp_path, home):
    (tmp_path / "file").write_text("x")
    environ = {"unset": {}, "empty": {"HOME": ""}, "a file": {"HOME": str(tmp_path / "file")},
               "under a file": {"HOME": str(tmp_path / "file" / "home")}}[home]
    launch = lab_launch({**environ, "JUPYTER_RUNTIME_DIR": "/mine/runtime"}, tmp="/tmp")
    assert launch.env["JUPYTER_CONFIG_DIR"] == "/tmp/jupyter-1000/config"
    assert launch.env["JUPYTER_DATA_DIR"] == "/tmp/jupyter-1000/data"
    assert launch.env["IPYTHONDIR"] == "/tmp/jupyter-1000/ipython"
    assert launch.env["MPLCONFIGDIR"] == "/tmp/jupyter-1000/matplotlib"
    assert launch.env["JUPYTER_RUNTIME_DIR"] == "/mine/runtime"  # one the user set is kept
    assert "/mine/runtime" not in launch.folders and len(launch.folders) == 4
    assert any("is not writable: Jupyter's files go to /tmp/jupyter-1000" in ln for ln in launch.lines)


def test_a_read_only_file_system_is_not_writable(monkeypatch, tmp_path):
    # root may write any folder, but not on a read-only file system (docker run --read-only): access() says so
    monkeypatch.setattr(servers.os, "access", lambda path, mode: False)
    assert not servers.writable(tmp_path)


# ---------------------------------------------------------------------------------------------------
# `dlenv lab` and `dlenv tensorboard` end to end, up to the exec


@pytest.fixture
def execs(monkeypatch):
    """The server each command would become, instead of becoming it."""
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, list(argv), dict(env)))
        return 0

    monkeypatch.setattr(servers.os, "execve", fake_execve)
    monkeypatch.setattr(servers, "installed", lambda module: True)
    return calls


def test_dlenv_lab_prints_the_url_once_then_becomes_jupyterlab(execs, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("JUPYTER_TOKEN", raising=False)
    monkeypatch.delenv("DLENV_LAB_PASSWORD", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    port = free_port()
    assert cli.main(["lab", "--port", str(port), "--root", str(tmp_path)]) == 0
    (path, argv, env), = execs
    token = env["JUPYTER_TOKEN"]
    assert path == sys.executable and argv[1] == "-c" and argv[3] == "jupyterlab" and len(token) == 48
    out = capsys.readouterr().out
    assert out.count(token) == 1 and f"http://127.0.0.1:{port}/lab?token={token}" in out
    assert f"--ServerApp.root_dir={tmp_path}" in argv


def test_dlenv_lab_makes_private_folders_when_home_is_not_writable(execs, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setattr(servers.tempfile, "gettempdir", lambda: str(tmp_path))
    assert cli.main(["lab", "--port", str(free_port())]) == 0
    runtime = Path(execs[0][2]["JUPYTER_RUNTIME_DIR"])
    assert runtime == tmp_path / f"jupyter-{os.getuid()}" / "runtime"
    assert runtime.is_dir() and runtime.stat().st_mode & 0o777 == 0o700


def test_dlenv_tensorboard_becomes_tensorboard_on_the_runs(execs, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLENV_IMAGE", raising=False)  # outside the image (this test runs inside it too)
    port = free_port()
    assert cli.main(["tensorboard", "--port", str(port)]) == 0
    (path, argv, _), = execs
    assert argv[1:] == ["-c", servers.TENSORBOARD_START, "--logdir=runs", "--host=127.0.0.1", f"--port={port}"]
    out = capsys.readouterr().out
    assert f"open http://127.0.0.1:{port}/" in out and "no runs yet" in out


@pytest.mark.parametrize(("argv", "message", "code"), [
    (["lab", "--root", "no/such/folder"], "--root no/such/folder: no such folder", 2),
    (["lab", "--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this machine", 2),  # TEST-NET-1
    (["tensorboard", "--log-dir", "a-file"], "--log-dir a-file is a file, not a folder", 2),
    (["tensorboard", "--log-dir", "rusn"], "--log-dir rusn: no such folder", 2),  # a typo; runs/ may come later
    (["tensorboard", "--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this machine", 2),
])
def test_bad_inputs_are_one_line(execs, capsys, tmp_path, monkeypatch, argv, message, code):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not execs


@pytest.mark.parametrize("verb", ["lab", "tensorboard"])
def test_a_port_in_use_is_one_line(execs, capsys, verb):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main([verb, "--port", str(port), "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    holder = {"lab": "(another JupyterLab or notebook server?)", "tensorboard": "(another TensorBoard?)"}[verb]
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 is in use {holder}; stop it or pass --port " in err


def test_the_port_named_instead_is_free():
    """Two ports held side by side: the one suggested is past both, and free."""
    with socket.socket() as first, socket.socket() as second:
        for _ in range(50):  # two neighbours of the ephemeral range
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                first.close()
                first = socket.socket()
        first.listen()
        second.listen()
        with pytest.raises(UserError, match=rf"port {port} on 127.0.0.1 is in use \(another TensorBoard\?\)") as e:
            servers.check_port("127.0.0.1", port, "another TensorBoard?")
        suggested = int(str(e.value).split("--port ")[1].split()[0])
        assert suggested > port + 1 and servers._bind_error("127.0.0.1", suggested) is None


@pytest.mark.parametrize(("verb", "module", "fix"), [
    ("lab", "jupyterlab", "python -m pip install 'jupyterlab>="), ("tensorboard", "tensorboard", "requirements.txt")])
def test_a_server_not_installed_is_one_line(monkeypatch, capsys, verb, module, fix):
    monkeypatch.setattr(servers, "installed", lambda m: m != module)
    assert cli.main([verb]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not installed in this Python" in err and fix in err


def test_both_verbs_are_invoke_tasks_without_torch():
    code = ("import sys; from dlenv.tasks import ns; names = set(ns.task_names); "
            "print(sorted({'lab', 'tensorboard'} & names)); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split("\n")[:2] == ["['lab', 'tensorboard']", "False"]


def test_the_lab_pins_agree_in_both_env_files():
    # the line that says the lab is missing names the image's own bounds
    for name in ("environment.yml", "environment.modern.yml"):
        env = yaml.safe_load((ROOT / name).read_text(encoding="utf-8"))
        pip = [ln for dep in env["dependencies"] if isinstance(dep, dict) for ln in dep["pip"]]
        assert servers.LAB_REQUIREMENT in pip, f"{name} lacks {servers.LAB_REQUIREMENT}"


# ---------------------------------------------------------------------------------------------------
# The runs TensorBoard finds, and a real TensorBoard


def write_events(run: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(run)) as w:
        for epoch in range(1, 4):
            w.add_scalar("train/loss", 1.0 / epoch, epoch)


def test_the_runs_summary_names_runs_with_and_without_event_files(tmp_path):
    runs = tmp_path / "runs"
    write_events(runs / "exp")
    (runs / "exp2").mkdir()
    (runs / "exp2" / "results.csv").write_text("epoch\n1\n")
    said = servers.runs_summary(runs)
    assert said.startswith("1 run(s) with event files: exp;") and "exp2 trained without --tensorboard" in said
    assert servers.runs_summary(tmp_path / "none") .startswith("no runs yet")


def _deep(root: Path, depth: int) -> Path:
    """root/d/d/.../d, `depth` folders below root, made one by one (os.makedirs recurses too)."""
    here = os.getcwd()
    root.mkdir(parents=True, exist_ok=True)
    os.chdir(root)
    try:
        for _ in range(depth):
            os.mkdir("d")
            os.chdir("d")
        return Path(os.getcwd())
    finally:
        os.chdir(here)


def _remove(top: Path) -> None:
    """Remove a tree of any depth: shutil.rmtree (and pytest's clean-up of old temporary folders) recurse."""
    folders, todo = [], [str(top)]
    while todo:
        folder = todo.pop()
        folders.append(folder)
        with os.scandir(folder) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                else:
                    os.unlink(e.path)
    for folder in reversed(folders):
        os.rmdir(folder)


TREES = ["1,500 folders deep", "1,500 deep with an event file at the bottom", "a loop of links", "a link out"]


@pytest.mark.parametrize("tree", TREES)
def test_the_runs_summary_of_any_tree_is_one_line(tmp_path, tree):
    """pathlib's rglob recursed: a tree 1,500 deep ended `dlenv tensorboard` in RecursionError (issue 43)."""
    runs = tmp_path / "runs"
    (runs / "exp").mkdir(parents=True)
    (runs / "exp" / "events.out.tfevents.1.host").write_bytes(b"")
    if tree.startswith("1,500"):
        bottom = _deep(runs / "deep", 1500)
        if "event" in tree:
            (bottom / "events.out.tfevents.2.host").write_bytes(b"")
    elif tree == "a loop of links":
        (runs / "exp" / "loop").symlink_to(runs)
    else:
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "events.out.tfevents.3.host").write_bytes(b"")
        (runs / "linked").symlink_to(tmp_path / "outside")
    try:
        said = servers.runs_summary(runs)
    finally:
        _remove(runs)
    n = 2 if "event" in tree else 1
    assert said.startswith(f"{n} run(s) with event files: ") and "\n" not in said and len(said) < 300, said
    assert ("deep/d/d" in said) == (n == 2) and "linked" not in said


@pytest.mark.slow
def test_tensorboard_serves_the_run_and_stops_on_sigterm(tmp_path):
    write_events(tmp_path / "runs" / "exp")
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "dlenv", "tensorboard", "--port", str(port)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline, runs = time.time() + 60, None
        while runs is None:
            assert time.time() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2) as r:
                    runs = json.load(r)
            except OSError:
                time.sleep(0.3)
        assert runs == ["exp"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugins_listing", timeout=5) as r:
            listing = json.load(r)  # the server dlenv execs has the event-data plugins only
        assert "scalars" in listing and set(listing) <= set(servers.EVENT_PLUGINS), sorted(listing)
        proc.send_signal(signal.SIGTERM)  # what tini passes on from `docker stop`: the exec'd server gets it
        # it ends on the signal (docker's grace period is 10 s; the wait is a safety net far above a second)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
    out = proc.stdout.read()
    assert out.startswith("dlenv tensorboard: serving runs/ (1 run(s) with event files: exp)"), out


# ---------------------------------------------------------------------------------------------------
# TensorBoard serves event files and nothing else (issue 43): no route of any enabled plugin hands out a
# file that a file in a run folder names

SECRET = "s3cr3t-outside-runs-" * 3
#: files a run folder can hold that name other files, each written with {secret} for the file to leak
NAMING_FILES = {
    "projector_config.pbtxt": 'model_checkpoint_path: "{secret}"\nembeddings {{ tensor_name: "t" tensor_path: '
                              '"{secret}" metadata_path: "{secret}" bookmarks_path: "{secret}" sprite {{ image_path: '
                              '"{secret}" single_image_dim: 1 single_image_dim: 1 }} }}\n',
    "plugins/projector/projector_config.pbtxt": 'embeddings {{ tensor_name: "t" metadata_path: "{secret}" }}\n',
    "checkpoint": 'model_checkpoint_path: "{secret}"\nall_model_checkpoint_paths: "{secret}"\n',
    "plugins/custom_scalars/config.pbtxt": '{secret}',
}


def _asked_everywhere(app, runs: list[str], tags: list[str]) -> dict[str, bytes]:
    """Every route of every enabled plugin (TensorBoard's own table of them), asked with each run and tag and
    with none, by GET and by POST; path -> every body it answered."""
    from werkzeug.test import Client

    client = Client(app)
    queries = [{}] + [{"run": r} for r in runs] + [{"run": r, "tag": t, "name": t, "embedding": t, "tensorName": t,
                                                    "sample": 0, "index": 0} for r in runs for t in tags]
    paths = list(app.exact_routes) + [p + rest for p in app.prefix_routes
                                      for rest in ("x", "etc/passwd", "%2e%2e/%2e%2e/etc/passwd")]
    def ask(method, path, q) -> bytes:
        try:
            return method(path, query_string=q, data=json.dumps({"experimentName": "", **q}),
                          content_type="application/json").get_data()
        except Exception:  # noqa: BLE001 (a real server answers 500 to what raises here: nothing leaks)
            return b""

    return {path: b"".join(ask(m, path, q) for q in queries for m in (client.get, client.post)) for path in paths}


@pytest.mark.slow
@pytest.mark.parametrize("outside", ["/etc/passwd", "a file of the user's"])
def test_tensorboard_serves_nothing_a_run_folders_files_name(tmp_path, outside):
    program = pytest.importorskip("tensorboard.program")
    from tensorboard import default
    from tensorboard.backend import application

    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    target = "/etc/passwd" if outside == "/etc/passwd" else str(secret)
    leak = Path(target).read_text().splitlines()[0].encode()  # its first line: 'root:x:0:0:...' or SECRET
    run = tmp_path / "runs" / "exp"
    write_events(run)
    for name, text in NAMING_FILES.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text.format(secret=target))
    (run / "events.out.tfevents.1.linked").symlink_to(target)  # an "event file" that is the secret

    board = program.TensorBoard(plugins=servers.event_plugins(default.get_plugins()))
    board.configure(logdir=str(tmp_path / "runs"), load_fast="false", reload_interval=0, reload_task="blocking")
    provider, multiplexer = board._make_data_provider()  # what TensorBoard.main serves, without a socket
    app = application.TensorBoardWSGIApp(board.flags, board.plugin_loaders, provider, board.assets_zip_provider,
                                         multiplexer)
    from werkzeug.test import Client

    listing = json.loads(Client(app).get("/data/plugins_listing").get_data())
    assert set(listing) <= set(servers.EVENT_PLUGINS) and {"scalars", "timeseries"} <= set(listing)
    assert not {"projector", "debugger-v2", "profile_redirect", "wit_redirect"} & set(listing)
    bodies = _asked_everywhere(app, ["exp", "."], ["train/loss", "t"])
    assert any(b'"train/loss"' in b for b in bodies.values())  # the event data is served
    leaked = sorted(p for p, b in bodies.items() if leak in b)
    assert not leaked, f"{target} served by {leaked}"
