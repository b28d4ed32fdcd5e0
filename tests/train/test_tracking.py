"""MLflow tracking (dlenv.train.tracking) with real stores: a local SQLite file, a port nothing listens on, and a
real `mlflow server` (slow: the image-pins lane). Tiny CPU runs of tests/tinymodels.py, read back with MlflowClient.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tinymodels import tiny_config

from dlenv import train as train_mod
from dlenv.errors import UserError
from dlenv.options import config
from dlenv.options.server_options import MlflowConfig
from dlenv.servers import mlflow_launch
from dlenv.train import tracking

#: the tests that write and read real stores; the rest run without MLflow (a lane's venv gets it from requirements.txt)
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="MLflow is not installed")


def MlflowClient(**kw):  # noqa: N802 (MLflow's class, imported where MLflow is there)
    from mlflow.tracking import MlflowClient as client

    return client(**kw)

SECRET = "s3cr3t-pw"


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """An empty MLflow SQLite store, made once: a new one runs MLflow's ~50 schema migrations, seconds each time."""
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def here(tmp_path, monkeypatch, empty_store):
    """The working folder is tmp_path, with an empty ./mlflow.db; no tracking URI from outside the test."""
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(tracking.URI_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return tmp_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_of(run_dir: str | Path, uri: str | None = None):
    client = MlflowClient(tracking_uri=uri or f"sqlite:///{Path('mlflow.db').absolute()}")
    run_id = (Path(run_dir) / tracking.RUN_ID_FILE).read_text().strip()
    return client, client.get_run(run_id)


def every_file(folder: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


@needs_mlflow
def test_local_store_holds_params_metrics_tags_and_artifacts(here, data, tiny, capsys):
    summary = train_mod.train(tiny_config(here, data, epochs=2, mlflow=True, mlflow_weights=True))
    assert summary["exit_code"] == 0
    client, run = run_of(summary["run_dir"])
    assert run.info.status == "FINISHED" and run.info.run_name == "exp"
    assert {k: run.data.params[k] for k in ("model", "epochs", "mlflow")} == {"model": "tiny", "epochs": "2",
                                                                              "mlflow": "True"}
    assert run.data.params["auto.precision"] == "fp32" and "auto.batch_rule" in run.data.params
    assert run.data.tags["gpu"] == "cpu" and run.data.tags["torch"] and run.data.tags["dlenv"]
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2]
    assert {"top1", "val_loss", "img_per_s", "optimizer_step", "epoch"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "results.csv", "best_model.pth", "last.pth"} <= artifacts
    assert "MLflow: run " in capsys.readouterr().out


@needs_mlflow
def test_stopped_then_resumed_is_one_mlflow_run_with_every_epoch_once(here, data, tiny):
    opts = dict(epochs=3, batch_size=2, accum_steps=2, mlflow=True)  # 4 optimizer steps an epoch

    def on_step(state):
        if state.step == 6:  # in epoch 2
            signal.raise_signal(signal.SIGTERM)

    part = train_mod.train(tiny_config(here, data, **opts), on_step=on_step)
    assert part["exit_code"] == 143
    _, run = run_of(part["run_dir"])
    assert run.info.status == "KILLED"
    report = Path(part["run_dir"], "val")  # a val report made meanwhile goes along; a link in it does not
    report.mkdir()
    (report / "metrics.json").write_text("{}")
    (report / "errors.csv").symlink_to(here / "mlflow.db")
    resumed = train_mod.train(tiny_config(here, data, resume=str(Path(part["run_dir"]) / "last.pth")))
    assert resumed["exit_code"] == 0
    client, again = run_of(part["run_dir"])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss")) == [1, 2, 3]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "val")] == ["val/metrics.json"]


@needs_mlflow
@pytest.mark.parametrize("uri", [
    "http://127.0.0.1:{port}",                          # nothing listens
    f"http://user:{SECRET}@127.0.0.1:{{port}}",         # and a password that must never show
])
def test_a_dead_server_costs_one_line_and_the_run_goes_on(here, data, tiny, capsys, monkeypatch, uri):
    monkeypatch.setenv(tracking.URI_ENV, uri.format(port=free_port()))  # on without --mlflow
    t0 = time.monotonic()
    summary = train_mod.train(tiny_config(here, data, epochs=2))
    out = capsys.readouterr()
    text = out.out + out.err
    assert summary["exit_code"] == 0 and time.monotonic() - t0 < 30
    failed = [ln for ln in text.splitlines() if ln.startswith("MLflow at ")]
    assert len(failed) == 1 and "training goes on" in failed[0], text
    assert "MLflow: not sent to" in text and "2 epoch(s)" in text
    assert len(Path(summary["run_dir"], "results.csv").read_text().splitlines()) == 3
    assert SECRET not in text and SECRET not in every_file(here)


@pytest.mark.parametrize("uri,shown", [
    ("http://u:pw@host:5000/x", "http://u:***@host:5000/x"),
    ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
    ("https://host", "https://host"),
])
def test_a_uri_is_shown_without_its_password(uri, shown):
    assert tracking.shown(uri) == shown
    assert "pw@" not in tracking.redact(f"failed: {uri}", uri)


@pytest.mark.parametrize("flag,env,tracks", [(False, "", False), (True, "", True), (False, "http://h", True),
                                             (False, "  ", False)])
def test_tracking_is_on_with_the_flag_or_the_variable(flag, env, tracks):
    assert tracking.wanted(flag, {tracking.URI_ENV: env}) is tracks


@pytest.mark.parametrize("text,kept", [("0123456789abcdef0123456789abcdef\n", "0123456789abcdef0123456789abcdef"),
                                       ("../../etc/passwd", None), ("x" * 500, None)])
def test_the_kept_run_id_is_read_as_untrusted(tmp_path, text, kept):
    (tmp_path / tracking.RUN_ID_FILE).write_text(text)
    assert tracking._kept_run_id(tmp_path) == kept


def test_without_mlflow_the_flag_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    monkeypatch.delenv(tracking.URI_ENV, raising=False)
    with pytest.raises(UserError) as e:
        tracking.require(True)
    assert "pip install 'mlflow" in str(e.value) and "\n" not in str(e.value)
    tracking.require(False)  # not asked: nothing to say


def test_the_mlflow_verb_serves_the_local_store_on_the_loopback(tmp_path):
    cfg = config.build(MlflowConfig, store=str(tmp_path / "mlflow.db"), port=5123)
    launch = mlflow_launch(cfg, {}, python="/py")
    assert f"--backend-store-uri=sqlite:///{tmp_path / 'mlflow.db'}" in launch.argv
    assert "--host=127.0.0.1" in launch.argv and "--port=5123" in launch.argv
    assert "no runs yet" in launch.lines[0] and "http://127.0.0.1:5123/" in launch.lines[1]
    assert launch.env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"  # seven processes that serve no run
    assert "--host=0.0.0.0" in mlflow_launch(cfg, {"DLENV_IMAGE": "1"}, python="/py").argv


@needs_mlflow
@pytest.mark.slow
def test_a_real_server_then_the_server_gone(here, data, tiny, capsys, monkeypatch):
    """`mlflow server` (SQLite, a local artifact folder) on 127.0.0.1: a run logs to it and is read back; then
    the server is killed mid-run: training ends normally, with the line."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", f"--backend-store-uri=sqlite:///{here}/mlflow.db",
                               f"--artifacts-destination={here}/art", "--host=127.0.0.1", f"--port={port}",
                               "--workers=1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=mlflow_launch(MlflowConfig(), os.environ, python="").env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("mlflow server did not start")
                time.sleep(0.3)
        monkeypatch.setenv(tracking.URI_ENV, uri)
        summary = train_mod.train(tiny_config(here, data, epochs=2, name="served"))
        client, run = run_of(summary["run_dir"], uri)
        assert run.info.status == "FINISHED" and run.data.params["model"] == "tiny"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "top1")) == [1, 2]
        assert {"config.yaml", "results.csv"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
        capsys.readouterr()

        def on_step(state):
            if state.step == 5 and server.poll() is None:  # epoch 2 of 4-step epochs
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()

        gone = train_mod.train(tiny_config(here, data, epochs=2, name="gone"), on_step=on_step)
        text = capsys.readouterr().out
        assert gone["exit_code"] == 0 and "MLflow at " in text and "MLflow: not sent to" in text
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
