"""MLflow tracking for `train --mlflow` (or whenever MLFLOW_TRACKING_URI is set): every MLflow call of dlenv
goes through the one `Tracker` here.

A run is one MLflow run: its options and what auto decided as params, GPU, torch, dlenv and the project's git
commit as tags, each epoch's results.csv row as metrics (MLflow's step is the epoch), and at the end the run
folder's files as artifacts (weights only with --mlflow-weights). Its id is kept in the run folder, so a
--resume continues the same MLflow run. Only rank 0 tracks.

A tracker that fails never stops training: a server that is down at the start or goes away mid-run costs
one line and a few seconds (short HTTP timeouts, no retries for our client), results.csv goes on, and what
could not be sent is tried once more at the end, or said. A URI's password never appears in a line: every
line and every MLflow log record is redacted.
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, optional_import, printable
from dlenv.files import safeio
from dlenv.files.atomic import write_text

URI_ENV = "MLFLOW_TRACKING_URI"
#: the local store in the working folder: MLflow 3.x deprecates its file store (./mlruns) for a SQLite one
LOCAL_STORE = "sqlite:///mlflow.db"
EXPERIMENT = "dlenv"              # MLFLOW_EXPERIMENT_NAME chooses another
RUN_ID_FILE = "mlflow_run_id"     # in the run folder: what a --resume continues
REQUIREMENT = "mlflow>=3.17,<3.18"
#: a dead server costs seconds, not minutes: MLflow's defaults are 120 s a request and 7 retries with backoff
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}
ARTIFACTS = ("config.yaml", "results.csv", "results.png", "memory.md")
REPORTS = "val*"                  # `dlenv val`'s report folders in the run folder (val/, val-test/)
WEIGHTS = ("best_model.pth", "last.pth")
_PARAM_CHARS = 6000               # MLflow's limit on a param's value


def wanted(flag: bool, environ: Mapping[str, str]) -> bool:
    """Whether a run tracks: --mlflow, or MLFLOW_TRACKING_URI set (to anything but empty)."""
    return flag or bool(environ.get(URI_ENV, "").strip())


def redact(text: str, uri: str) -> str:
    """`text` with the password (and user) of `uri` replaced by ***, wherever it appears."""
    parts = urllib.parse.urlsplit(uri)
    for secret in (parts.password, parts.username and parts.password and f"{parts.username}:{parts.password}"):
        if secret:
            text = text.replace(secret, "***").replace(urllib.parse.quote(secret, safe=""), "***")
    return text


def shown(uri: str) -> str:
    """The URI as a line may show it: without its password."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return printable(uri)
    host = parts.netloc.rsplit("@", 1)[-1]
    return printable(urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}")))


def git_commit(folder: Path) -> str | None:
    """The commit checked out in `folder` (the user's project) when it is a git repository, else None."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=5,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", sha) else None


def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested options and notes as MLflow params: dotted keys, text values within MLflow's limit."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat(v, key + "."))
        else:
            out[key] = str(v)[:_PARAM_CHARS]
    return out


class _Redact(logging.Filter):
    """Takes the passwords of the URIs tracked to out of every log record a handler writes (MLflow's, urllib3's)."""

    uris: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.uris:
            text = record.getMessage()
            for uri in self.uris:
                text = redact(text, uri)
            record.msg, record.args = text, None
        return True


_REDACT = _Redact()


def _redact_logs(uri: str) -> None:
    """Every handler MLflow's records reach (its own, the root's, logging's last resort) redacts `uri`."""
    _Redact.uris.add(uri)
    for handler in (*logging.getLogger("mlflow").handlers, *logging.getLogger().handlers, logging.lastResort):
        if handler is not None and _REDACT not in handler.filters:
            handler.addFilter(_REDACT)


class Tracker:
    """One MLflow run of one dlenv run. Each method returns normally whatever MLflow does; the first failure
    is said in one line and later calls only keep what is to be sent, until `close` tries once more."""

    def __init__(self, client: Any, entities: Any, uri: str, run_dir: Path, say: Callable[[str], None],
                 weights: bool) -> None:
        self.client, self.entities, self.uri, self.run_dir = client, entities, uri, run_dir
        self.say, self.weights = say, weights
        self.run_id: str | None = None
        self.down = False                       # a call failed: later ones wait for `close`
        self.said = False                       # the failure's one line is out
        self.pending: list[Any] = []            # metrics not sent yet
        self.params: dict[str, str] = {}        # not sent yet
        self.tags: dict[str, str] = {}

    # -- the three moments of a run -------------------------------------------------------------------------

    def start(self, params: dict[str, str], tags: dict[str, str]) -> None:
        """The MLflow run: the one whose id the run folder keeps (a resume), else a new one with `params`."""
        self.params, self.tags = params, tags
        self._try(self._open)

    def epoch(self, row: Mapping[str, Any], step: int) -> None:
        """One results.csv row as metrics at MLflow step = its epoch, with `optimizer_step`."""
        ts, epoch = int(time.time() * 1000), int(row["epoch"])
        values = {**row, "optimizer_step": step}
        self.pending += [self.entities.Metric(k, float(v), ts, epoch) for k, v in values.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
        if not self.down:
            self._try(self._send)

    def close(self, status: str) -> None:
        """The end (FINISHED, KILLED for a stop, FAILED): what was not sent, then the artifacts and the status;
        one try more after a failure, then one line saying what stayed behind."""
        if self.down:
            self.down = False
            if not self._try(self._open):
                return self._left_behind()
        if not (self._try(self._send) and self._try(self._artifacts) and self._try(
                lambda: self.client.set_terminated(self.run_id, status=status))):
            self._left_behind()
        return None

    # -- MLflow -------------------------------------------------------------------------------------------------

    def _open(self) -> None:
        if self.run_id is None:
            self.run_id = _kept_run_id(self.run_dir)
            if self.run_id is not None:
                try:
                    have = self.client.get_run(self.run_id).data.params
                    self.client.update_run(self.run_id, status="RUNNING")
                    # a param MLflow has cannot change (--resume's own value does): the first start's stay
                    self.params = {k: v for k, v in self.params.items() if k not in have}
                except Exception as e:
                    if "RESOURCE_DOES_NOT_EXIST" not in str(e) and "not found" not in str(e).lower():
                        self.run_id = None
                        raise
                    self.say(f"MLflow: run {self.run_id} kept in {self.run_dir} is not in {shown(self.uri)}; "
                             "starting a new MLflow run")
                    self.run_id = None
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(exp_id, run_name=self.run_dir.name).info.run_id
            write_text(self.run_dir / RUN_ID_FILE, self.run_id + "\n")
        if self.tags:
            self.client.log_batch(self.run_id, tags=[self.entities.RunTag(k, v) for k, v in self.tags.items()])
            self.tags = {}
        items = list(self.params.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=[self.entities.Param(k, v) for k, v in items[i:i + 100]])
        self.params = {}

    def _send(self) -> None:
        while self.pending:
            self.client.log_batch(self.run_id, metrics=self.pending[:1000])
            del self.pending[:1000]

    def _artifacts(self) -> None:
        for name in (*ARTIFACTS, *(WEIGHTS if self.weights else ())):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        # a val report already there (a run continued in its folder): its files, never what a link points to
        for folder in sorted(self.run_dir.glob(REPORTS)):
            if folder.is_dir() and not folder.is_symlink():
                for f in sorted(folder.iterdir()):
                    if f.suffix in (".json", ".csv", ".png") and f.is_file() and not f.is_symlink():
                        self.client.log_artifact(self.run_id, str(f), folder.name)

    def _try(self, work: Callable[[], None]) -> bool:
        try:
            work()
            return True
        except Exception as e:  # MLflow's, requests', sqlite's: a tracker never stops training
            if not self.said:
                self.said = True
                what = redact(" ".join(str(e).split()), self.uri)[:200]  # cut after: never half a password
                self.say(f"MLflow at {shown(self.uri)} failed ({type(e).__name__}: {what}); training goes on, "
                         "results.csv has every epoch; what was not sent is tried again at the end (is the server "
                         f"up? unset {URI_ENV} or leave out --mlflow to train without it)")
            self.down = True
            return False

    def _left_behind(self) -> None:
        epochs = sorted({m.step for m in self.pending})
        self.say(f"MLflow: not sent to {shown(self.uri)}: {len(epochs)} epoch(s) of metrics, the artifacts and the "
                 f"run's end; every value is in {printable(str(self.run_dir))} (results.csv, config.yaml)")


def _kept_run_id(run_dir: Path) -> str | None:
    """The MLflow run id a run folder keeps (a file read as untrusted: small, hex only), or None."""
    try:
        text = safeio.read_regular(run_dir / RUN_ID_FILE, 100, RUN_ID_FILE).decode("ascii", "replace").strip()
    except (OSError, UserError):  # none, or not a small regular file (a FIFO, a link to a kernel file, ...)
        return None
    return text if re.fullmatch(r"[0-9a-f]{32}", text) else None


def require(flag: bool) -> None:
    """Refuse a run that tracks (`wanted`) where MLflow is not installed: one line naming the package, before
    anything is built. Raises UserError."""
    if wanted(flag, os.environ):
        how, off = ("--mlflow", "leave out --mlflow") if flag else (f"{URI_ENV} is set", f"unset {URI_ENV}")
        optional_import("mlflow", f"{how}: MLflow is not installed in this Python; install it with python -m pip "
                                  f"install '{REQUIREMENT}', or {off} to train without it")  # UserError without it


def open_tracker(flag: bool, weights: bool, run_dir: Path, say: Callable[[str], None],
                 params: dict[str, str], tags: dict[str, str]) -> Tracker | None:
    """The tracker of a run when it tracks (`wanted`), started; None otherwise. Raises UserError (one line naming
    the package) when MLflow is not installed."""
    if not wanted(flag, os.environ):
        return None
    # the local store by its absolute path: MLflow keeps one store per URI for the process's life
    uri = os.environ.get(URI_ENV, "").strip() or f"sqlite:///{Path(LOCAL_STORE.removeprefix('sqlite:///')).absolute()}"
    for k, v in HTTP_ENV.items():  # read by MLflow at each request; a value the user set is kept
        os.environ.setdefault(k, v)
    require(flag)
    from mlflow import entities  # optional: inside mlflow
    from mlflow.tracking import MlflowClient  # optional: inside mlflow

    _redact_logs(uri)
    for name in ("alembic", "mlflow.store.db.utils"):  # a new local store's migration log: not for the console
        logging.getLogger(name).setLevel(logging.WARNING)
    tracker = Tracker(MlflowClient(tracking_uri=uri), entities, uri, run_dir, say, weights)
    tracker.start(params, tags)
    if not tracker.down:
        local = not os.environ.get(URI_ENV, "").strip()
        say(f"MLflow: run {tracker.run_id} in {shown(uri)}" + (" (dlenv mlflow serves it)" if local else ""))
    return tracker
