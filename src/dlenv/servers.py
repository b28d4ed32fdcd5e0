"""`dlenv lab`, `dlenv tensorboard` and `dlenv mlflow`: JupyterLab, TensorBoard and the MLflow UI on this Python,
each in one command.

Each command builds a `Launch` (the server's command line, its environment, the lines printed first)
from its options and this machine, in pure functions the tests call, then prints those lines and
*becomes* the server (os.execve): under the image's tini the server itself receives `docker stop`'s
SIGTERM and exits on it, with no dlenv process in between to forward or swallow signals.

The lab in brief: JupyterLab on 0.0.0.0:8888 in the image (127.0.0.1 elsewhere), opening the working
folder (/root/workspace), with this Python as its kernel (the image's `dl` env); no browser; a token made
here and printed once, in the URL to open (JUPYTER_TOKEN to choose it, DLENV_LAB_PASSWORD for a password
instead). Jupyter's own folders go to a private folder under /tmp when HOME cannot be written (`docker run
--user` without the image's entrypoint, --read-only), and nothing asks the internet for news or updates.
TensorBoard serves runs/ (each run's event files, written by `train --tensorboard`) on 6006, with no login:
only the plugins that show what event files hold (`EVENT_PLUGINS`), none that follows a path a file names
(the projector served any file a run folder's projector_config.pbtxt named, /etc/passwd included). It is
started as `python -c TENSORBOARD_START`, which drops the working folder `-c` puts first on sys.path, so a
`tensorboard/` package lying there is not the one that runs.
"""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import os
import secrets
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlenv import invocation
from dlenv.errors import EXIT_FAULT, UserError, need_folder, printable

#: what the image installs (environment*.yml); named in the line that says the lab is missing
LAB_REQUIREMENT = "jupyterlab>=4.6,<4.7"
TOKEN_ENV = "JUPYTER_TOKEN"              # Jupyter's own: a token of the user's choosing
PASSWORD_ENV = "DLENV_LAB_PASSWORD"      # a password instead of a token (hashed here, never on a command line)
#: Jupyter's folders (and IPython's and Matplotlib's, which a kernel writes) when HOME is not writable
JUPYTER_DIRS = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
                "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "matplotlib"}
EVENTS = "events.out.tfevents.*"


@dataclass(frozen=True)
class Launch:
    """A server to become: its command line, its whole environment, the lines to print before it starts,
    and the folders to create (private, 0700) first."""

    argv: list[str]
    env: dict[str, str]
    lines: list[str]
    folders: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------
# Where a server listens and how a person reaches it


def in_image(environ: Mapping[str, str]) -> bool:
    return environ.get("DLENV_IMAGE") == "1"


def listen_host(host: str, environ: Mapping[str, str]) -> str:
    """The address to bind: --host as given, or for auto every address in the image (a container's own
    loopback is unreachable through `docker run -p`) and only the loopback elsewhere."""
    if host != "auto":
        return host
    return "0.0.0.0" if in_image(environ) else "127.0.0.1"


def open_url(host: str, port: int, path: str = "/") -> str:
    """The URL a person opens: a server on every address is opened on the loopback (what `-p` and an
    SSH tunnel deliver to)."""
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    name = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"http://{name}:{port}{path}"


def reach_hint(host: str, port: int, environ: Mapping[str, str]) -> str:
    """How to get to the port from the machine with the browser."""
    tunnel = f"ssh -N -L {port}:127.0.0.1:{port} you@the-box"
    if in_image(environ):
        return f"publish the port with docker run -p {port}:{port}; on a rented box, first run {tunnel} on your machine"
    if ipaddress.ip_address(host).is_loopback:
        return f"this machine only; from another one: {tunnel}"
    return f"on every address of this machine at port {port}"


#: ports past the one asked that `check_port` tries, to name a free one
PORT_TRIES = 20


def check_port(host: str, port: int, holder: str) -> None:
    """Refuse, in one line, a port another program holds (naming the likely `holder`, e.g. "another
    TensorBoard?", and a port that is free now) or an address this machine does not have: the servers' own
    messages for these are a page of log, or, once dlenv has become the server, nothing of dlenv's."""
    error = _bind_error(host, port)
    if error == errno.EADDRINUSE:
        free = next((p for p in range(port + 1, min(port + 1 + PORT_TRIES, 65536)) if _bind_error(host, p) is None),
                    None)
        way = f"--port {free}" if free else "another --port"
        raise UserError(f"port {port} on {host} is in use ({holder}); stop it or pass {way} (and publish that port)")
    if error == errno.EADDRNOTAVAIL:
        raise UserError(f"--host {host} is not an address of this machine; leave --host out (auto) or "
                        "pass 0.0.0.0 or 127.0.0.1")
    if error == errno.EACCES:
        raise UserError(f"port {port} needs privileges here; pass a port above 1023")
    if error is not None:
        raise UserError(f"port {port} on {host} cannot be opened: {os.strerror(error)}; pass another --port or --host")


def _bind_error(host: str, port: int) -> int | None:
    """The errno binding `host`:`port` fails with, as the servers bind (SO_REUSEADDR: a closed server's
    connections in TIME_WAIT do not hold the port); None when it is free."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno
    return None


# ---------------------------------------------------------------------------------------------------
# JupyterLab


def writable(path: str | os.PathLike[str] | None) -> bool:
    """Whether a folder can be written, or made in the nearest folder above it that exists (a read-only
    file system counts as not writable, for root too)."""
    if not path:
        return False
    p = Path(path)
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def jupyter_dirs(environ: Mapping[str, str], tmp: str, uid: int) -> dict[str, str]:
    """The folders to point Jupyter, IPython and Matplotlib at: none while HOME is writable (their own
    places under it, where settings persist), else a private folder under `tmp` for each the user has
    not set (Jupyter would fail to write its runtime files, kernels their history and caches)."""
    if writable(environ.get("HOME")):
        return {}
    base = Path(tmp) / f"jupyter-{uid}"
    return {var: str(base / sub) for var, sub in JUPYTER_DIRS.items() if not environ.get(var)}


def auth(environ: Mapping[str, str], make_token: Callable[[], str],
         hash_password: Callable[[str], str]) -> tuple[list[str], dict[str, str], str, str]:
    """How the lab is entered: (Jupyter arguments, environment to set, the URL's query, what it says).

    A token made here (the default) or JUPYTER_TOKEN's; DLENV_LAB_PASSWORD: a password (hashed for
    Jupyter), and then no token. Raises UserError for an empty one: Jupyter would let anyone in.
    """
    for var in (TOKEN_ENV, PASSWORD_ENV):
        if var in environ and not environ[var].strip():
            raise UserError(f"{var} is set but empty, which would open the lab to anyone who reaches the port; "
                            f"set it to a secret or unset it (a token is then made and printed)")
    if PASSWORD_ENV in environ:
        hashed = hash_password(environ[PASSWORD_ENV])
        return ([f"--PasswordIdentityProvider.hashed_password={hashed}", "--IdentityProvider.token="],
                {}, "", f"the password in {PASSWORD_ENV}")
    if TOKEN_ENV in environ:
        return [], {}, f"?token=${TOKEN_ENV}", f"the token in {TOKEN_ENV}"
    token = make_token()
    # through the environment, not the command line, where `ps` and `docker top` would show it
    return [], {TOKEN_ENV: token}, f"?token={token}", "a token made for this server"


def lab_launch(cfg: Any, environ: Mapping[str, str], *, python: str, prefix: str, euid: int, uid: int,
               tmp: str, make_token: Callable[[], str] = lambda: secrets.token_hex(24),
               hash_password: Callable[[str], str] = lambda pw: pw) -> Launch:
    """The JupyterLab server `dlenv lab` becomes (see the module's docstring for what and why)."""
    host = listen_host(cfg.host, environ)
    root = os.path.abspath(cfg.root)
    auth_args, auth_env, query, how = auth(environ, make_token, hash_password)
    dirs = jupyter_dirs(environ, tmp, uid)
    env = {k: v for k, v in environ.items() if k != "MPLBACKEND"}  # the image's Agg would hide notebook figures
    env.update(dirs)
    env.update(auth_env)
    argv = [*invocation.python_module("jupyterlab", python), "--no-browser",
            f"--ServerApp.ip={host}", f"--ServerApp.port={cfg.port}",
            "--ServerApp.port_retries=0",          # the published port or nothing: not 8889 behind -p 8888:8888
            f"--ServerApp.root_dir={root}",
            # no network from the server: no news feed, no update checks, no PyPI extension listings
            "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            *(["--allow-root"] if euid == 0 else []),  # root in a container is the usual user there
            *auth_args]
    url = open_url(host, cfg.port, "/lab") + query
    lines = [f"dlenv lab: JupyterLab on {host}:{cfg.port}, opening {root}; kernel: Python {sys.version.split()[0]} "
             f"of {prefix}",
             f"dlenv lab: open {url} ({how}; {reach_hint(host, cfg.port, environ)})"]
    if dirs:
        lines.append(f"dlenv lab: HOME ({environ.get('HOME') or 'unset'}) is not writable: Jupyter's files go to "
                     f"{Path(next(iter(dirs.values()))).parent} (gone with the container)")
    return Launch(argv, env, lines, tuple(dirs.values()))


def lab(cfg: Any) -> int:
    """`dlenv lab`: becomes JupyterLab (returns only by raising UserError)."""
    if not installed("jupyterlab"):
        raise UserError(f"JupyterLab is not installed in this Python ({sys.executable}); the dlenv image has it, "
                        f"elsewhere: python -m pip install '{LAB_REQUIREMENT}'", EXIT_FAULT)
    need_folder(cfg.root, "--root", "pass the folder the lab should open")

    def hash_password(pw: str) -> str:
        from jupyter_server.auth import passwd  # argon2, Jupyter's own format

        return passwd(pw)

    launch = lab_launch(cfg, os.environ, python=sys.executable, prefix=sys.prefix, euid=os.geteuid(),
                        uid=os.getuid(), tmp=tempfile.gettempdir(), hash_password=hash_password)
    check_port(listen_host(cfg.host, os.environ), cfg.port, "another JupyterLab or notebook server?")
    return become(launch)


# ---------------------------------------------------------------------------------------------------
# TensorBoard


def runs_summary(log_dir: Path) -> str:
    """What TensorBoard will find in `log_dir`: its runs with event files, and runs without any."""
    if not log_dir.exists():
        return "no runs yet; they appear as `dlenv train --tensorboard` writes them"
    folders = _folders_with_events(log_dir)
    with_events = sorted(str(f.relative_to(log_dir)) for f in folders)
    top = {f.relative_to(log_dir).parts[0] for f in folders if f != log_dir}
    without = sorted(p.parent.name for p in log_dir.glob("*/results.csv") if p.parent.name not in top)
    said = (f"{len(with_events)} run(s) with event files: {_some(with_events)}" if with_events
            else "no event files yet: train with --tensorboard")
    if without:
        said += f"; {_some(without)} trained without --tensorboard (their curves: dlenv plot)"
    return said


def _folders_with_events(root: Path) -> set[Path]:
    """The folders under `root` (itself too) holding an event file, found by a walk with a list of its own
    (pathlib's rglob recurses: a tree 1,500 folders deep ended `dlenv tensorboard` in RecursionError); links
    to folders are not followed, so a loop of links ends too."""
    import fnmatch

    found, todo = set(), [str(root)]
    while todo:
        folder = todo.pop()
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
                    elif fnmatch.fnmatchcase(e.name, EVENTS):
                        found.add(Path(folder))
        except OSError:  # unreadable or gone while walked: TensorBoard will not read it either
            continue
    return found


def _some(names: list[str], most: int = 6, width: int = 60) -> str:
    """The first `most` names, each cut in the middle to `width` characters, and how many more."""
    cut = [n if len(n) <= width else n[: width // 2 - 1] + "..." + n[-(width // 2 - 2):] for n in names[:most]]
    return ", ".join(cut) + (f" and {len(names) - most} more" if len(names) > most else "")


#: TensorBoard's plugins (by plugin_name) that show what event files hold, and nothing else: `train
#: --tensorboard` writes scalars, and a loop of the user's may write any of these summaries. "core" serves
#: the page and the list of runs; "timeseries" is the Time Series dashboard. Left out: projector (it reads
#: whatever file a projector_config.pbtxt or a run file in a run folder names), debugger-v2 (debug dumps,
#: not event files), the profile and what-if-tool redirects, and every plugin another package installs
EVENT_PLUGINS = ("core", "timeseries", "scalars", "custom_scalars", "images", "audio", "graphs", "distributions",
                 "histograms", "text", "pr_curves", "hparams", "mesh")
#: what `dlenv tensorboard` execs with `python -c`: -c puts the working folder first on sys.path (a
#: `tensorboard/` or `absl/` there would be imported in place of the real one); it leaves before any import
TENSORBOARD_START = ("import sys\n"
                     "if sys.path[:1] == ['']: del sys.path[0]\n"
                     "from dlenv.servers import serve_event_files\n"
                     "serve_event_files(sys.argv[1:])\n")


def event_plugins(loaders: list[Any]) -> list[Any]:
    """The loaders among TensorBoard's (`tensorboard.default.get_plugins()`) whose plugin is in EVENT_PLUGINS."""
    def name(loader: Any) -> str | None:
        if type(loader).__name__ == "CorePluginLoader":  # the one loader object; the others are plugin classes
            return "core"
        return getattr(loader, "plugin_name", None)

    return [p for p in loaders if name(p) in EVENT_PLUGINS]


def serve_event_files(argv: list[str]) -> None:
    """TensorBoard with its event-data plugins only, on TensorBoard's own flags `argv`: what `dlenv tensorboard`
    becomes (tensorboard.main's start, with the plugins chosen). Exits as TensorBoard does."""
    from absl import app  # TensorBoard's own dependency: only where TensorBoard runs
    from tensorboard import default, main_lib, program
    from tensorboard.plugins import base_plugin

    main_lib.global_init()
    board = program.TensorBoard(plugins=event_plugins(default.get_plugins()))
    try:
        app.run(board.main, argv=["tensorboard", *argv], flags_parser=board.configure)
    except base_plugin.FlagsError as e:
        print(f"dlenv tensorboard: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_FAULT) from None


def tensorboard_launch(cfg: Any, environ: Mapping[str, str], *, python: str) -> Launch:
    """The TensorBoard server `dlenv tensorboard` becomes: event data only, from `python -c TENSORBOARD_START`."""
    host = listen_host(cfg.host, environ)
    log_dir = Path(cfg.log_dir)
    argv = [python, "-c", TENSORBOARD_START, f"--logdir={log_dir}", f"--host={host}", f"--port={cfg.port}"]
    lines = [f"dlenv tensorboard: serving {printable(str(log_dir))}/ ({runs_summary(log_dir)})",
             f"dlenv tensorboard: open {open_url(host, cfg.port)} ({reach_hint(host, cfg.port, environ)})"]
    return Launch(argv, dict(environ), lines)


def tensorboard(cfg: Any) -> int:
    """`dlenv tensorboard`: becomes TensorBoard on cfg.log_dir (returns only by raising UserError)."""
    from dlenv.options.server_options import TensorboardConfig

    if not installed("tensorboard"):
        raise UserError(f"TensorBoard is not installed in this Python ({sys.executable}); the dlenv image has it, "
                        "elsewhere: python -m pip install -r requirements.txt", EXIT_FAULT)
    # runs/ may appear later (the first `train --tensorboard` makes it); a folder named by hand that is not
    # there is far more often a typo, which would serve an empty page without a word
    if os.path.lexists(cfg.log_dir) or Path(cfg.log_dir) != Path(TensorboardConfig().log_dir):
        need_folder(cfg.log_dir, "--log-dir", "pass the folder your runs are in (--project of train, runs/ by "
                    "default)")
    launch = tensorboard_launch(cfg, os.environ, python=sys.executable)
    check_port(listen_host(cfg.host, os.environ), cfg.port, "another TensorBoard?")
    return become(launch)


# ---------------------------------------------------------------------------------------------------
# MLflow

#: what `dlenv mlflow` execs with `python -c` (as TENSORBOARD_START: no module of the working folder first)
MLFLOW_START = ("import sys\n"
                "if sys.path[:1] == ['']: del sys.path[0]\n"
                "from mlflow.cli import cli\n"
                "cli(prog_name='mlflow')\n")


def mlflow_launch(cfg: Any, environ: Mapping[str, str], *, python: str) -> Launch:
    """The MLflow UI `dlenv mlflow` becomes: `mlflow server` over the local SQLite store train --mlflow writes,
    one worker, no login (as TensorBoard)."""
    host = listen_host(cfg.host, environ)
    store = Path(cfg.store).absolute()
    argv = [python, "-c", MLFLOW_START, "server", f"--backend-store-uri=sqlite:///{store}", f"--host={host}",
            f"--port={cfg.port}", "--workers=1"]
    runs = "" if store.is_file() else " (no runs yet; they appear as `dlenv train --mlflow` writes them)"
    lines = [f"dlenv mlflow: serving {printable(str(store))}{runs}",
             f"dlenv mlflow: open {open_url(host, cfg.port)} ({reach_hint(host, cfg.port, environ)})"]
    # MLflow 3's job runner (GenAI evaluation jobs: seven more processes, ~270 MB each) serves nothing of a run's
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **environ}
    return Launch(argv, env, lines)


def mlflow_ui(cfg: Any) -> int:
    """`dlenv mlflow`: becomes the MLflow UI over cfg.store (returns only by raising UserError)."""
    from dlenv.options.server_options import MlflowConfig

    if not installed("mlflow"):
        raise UserError(f"MLflow is not installed in this Python ({sys.executable}); the dlenv image has it, "
                        "elsewhere: python -m pip install -r requirements.txt", EXIT_FAULT)
    if Path(cfg.store) != Path(MlflowConfig().store) and not Path(cfg.store).is_file():
        raise UserError(f"--store {printable(cfg.store)}: no such file; pass the mlflow.db train --mlflow wrote "
                        "(in the folder you trained in), or leave --store out")
    launch = mlflow_launch(cfg, os.environ, python=sys.executable)
    check_port(listen_host(cfg.host, os.environ), cfg.port, "another MLflow server?")
    return become(launch)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def become(launch: Launch) -> int:
    """Print the launch's lines, make its folders, and replace this process with the server."""
    for folder in launch.folders:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if os.stat(folder).st_uid != os.getuid():  # someone else's, in a shared /tmp: not for our tokens
            raise UserError(f"{folder} belongs to another user; set {', '.join(JUPYTER_DIRS)} to folders of yours")
    for line in launch.lines:
        print(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(launch.argv[0], launch.argv, launch.env)
    return 0  # not reached: execve returns only by raising
